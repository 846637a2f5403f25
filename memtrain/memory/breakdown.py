"""An independent count of one optimizer step's memory (``logging.memory_breakdown_step``).

torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a ``TorchDispatchMode``) sees
every tensor storage an operator creates and frees, whoever calls it: the model, autograd, the
engine (DDP's buckets, FSDP2's gathered parameters, DeepSpeed's partitions and reduce buffers)
and the optimizer. It is entered before the model is built, so model state and engine buffers
created at start-up are counted; its peak is restarted when the chosen step begins, and the
step's peak (forward, backward and optimizer update of every micro-batch) is written per rank to
``OUTPUT_DIR/memory_breakdown/rank_XXXXX.json``, beside two other moments of the run: the peak
before the step began (the model's build, the engine's set-up and, on a resume, the checkpoint's
load: the start-up moment when the counted step is the first the process runs) and, when the
counted step is the run's last, the export's peak (the consolidated model gathered and written).
Nothing here comes from memtrain's own accounting: ``benchmarks/memory_accuracy.py`` and
``benchmarks/moment_accuracy.py`` set the two side by side.

What it does not see (torch's limits): memory allocated outside torch's operators (a C++
library's own buffers, pinned host staging of DeepSpeed's CPU Adam), and on CUDA the caching
allocator's fragmentation (``torch.cuda.max_memory_allocated`` is written beside it there).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Iterator, Optional

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
        self._tracker, self._record, self._before, self._before_peak = None, None, {}, {}

    def start(self) -> "MemoryBreakdown":
        """Enter the tracker (before the model is built)."""
        if self.step > 0:
            self._tracker = _tracker()
            self._tracker.__enter__()
        return self

    def before_step(self, step: int) -> None:
        """Restart the peak when ``step`` is the counted one (MemTracker keeps its peak since
        it was entered; its two peak fields are reset to the current count), keeping the peak
        so far as the start-up moment's; leave the tracker when a step after it begins."""
        if self._tracker is None:
            return
        if step != self.step:
            if step > self.step:
                self.close()  # the counted step was not the run's last: no export to count
            return
        self._before = self._tracker.get_tracker_snapshot("current")
        self._before_peak = self._restart_peak()

    def _restart_peak(self) -> dict:
        """The tracker's peak snapshot so far; its peak is then the current count."""
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        tracker = self._tracker
        peak = tracker.get_tracker_snapshot("peak")
        tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
        tracker._peak_mem = {device: snap[_TOTAL] for device, snap in tracker._peak_mem_snap.items()}
        return peak

    def after_step(self, step: int) -> Optional[dict]:
        """When ``step`` is the counted one: write and return its record. The tracker stays
        entered until the next step begins (then it leaves: later steps run without its
        overhead) or, when this was the run's last step, through the export
        (:meth:`export_moment`).

        Returns:
            ``{"step", "rank", "device", "peak_bytes", "peak_by_category", "before_step_bytes",
            "before_step_peak_bytes", "before_step_peak_by_category", "cuda_max_memory_allocated"}``
            (bytes; categories are MemTracker's: Parameter, Buffer, Gradient, Activation, Temp,
            Optimstate, Other; ``before_step_peak_*``: the peak from before the model's build
            until the step began), or None.
        """
        if self._tracker is None or step != self.step:
            return None
        peak = self._tracker.get_tracker_snapshot("peak")
        device = max(peak, key=lambda d: peak[d][_TOTAL]) if peak else None
        self._record = {
            "step": step, "rank": self.rank, "device": str(device),
            "peak_bytes": int(peak[device][_TOTAL]) if device is not None else 0,
            "peak_by_category": _categories(peak, device),
            "before_step_bytes": _total(self._before, device),
            "before_step_peak_bytes": _total(self._before_peak, device),
            "before_step_peak_by_category": _categories(self._before_peak, device),
            "cuda_max_memory_allocated": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}
        self._write()
        return self._record

    @contextmanager
    def export_moment(self) -> Iterator[None]:
        """Around the run's export: when the counted step was the last, the record gains
        ``export_peak_bytes`` and ``export_before_bytes`` (the count when the export began) and
        the tracker leaves; otherwise nothing is counted."""
        if self._tracker is None or self._record is None:
            yield
            return
        device = self._record["device"]
        before = _total(self._tracker.get_tracker_snapshot("current"), device)
        self._restart_peak()
        try:
            yield
            self._record.update(export_before_bytes=before,
                                export_peak_bytes=_total(self._tracker.get_tracker_snapshot("peak"), device))
            self._write()
        finally:
            self.close()

    def _write(self) -> None:
        folder = os.path.join(self.output_dir, "memory_breakdown")
        os.makedirs(folder, exist_ok=True)
        write_atomic(os.path.join(folder, f"rank_{self.rank:05d}.json"), json.dumps(self._record, indent=1))

    def close(self) -> None:
        """Leave the tracker (idempotent)."""
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)


def _total(snapshot: dict, device) -> int:
    """A MemTracker snapshot's total bytes on ``device`` (0 when it holds none)."""
    for key, value in snapshot.items():
        if str(key) == str(device):
            return int(value[_TOTAL])
    return 0


def _categories(snapshot: dict, device) -> dict[str, int]:
    """A MemTracker snapshot's bytes on ``device`` by category (its ``Total`` left out)."""
    for key, value in snapshot.items():
        if str(key) == str(device):
            return {getattr(k, "value", str(k)): int(v) for k, v in value.items() if k != _TOTAL}
    return {}


class _NoHook:
    """Stands for the gradient hooks a frozen parameter does not get (removing it does nothing)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _tracker():
    """A ``MemTracker`` that counts a whole run: it forgets its per-module statistics when the
    root module is called again (each micro-batch, each evaluation), where the stock one stops
    with ``NotImplementedError``; tensor counts, categories and peaks are untouched.

    Its module tracker is not shown a module's inputs that are parameters (leaf tensors that
    require a gradient: a weight-norm parametrization's, called with its ``original0`` and
    ``original1``, as wav2vec2's and WavLM's positional convolution is). torch 2.13's
    ``ModTracker`` registers a gradient hook of mode ``all`` on a module's grad-requiring inputs
    at every forward (``register_multi_grad_hook``); on a parameter the hook lives as long as the
    parameter and its buffer keeps the gradient of every backward whose other gradients never
    reach it: memory the tracker holds, not the run (a WavLM of 0.5M parameters under ZeRO-3 in
    bf16: three copies of its positional convolution's gradient, 393 kB, 1.5% of its peak)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class RunTracker(MemTracker):
        def __init__(self):
            super().__init__()
            module_pre_hook = self._mod_tracker._fw_pre_hook

            def without_parameters(module, args):
                return module_pre_hook(module, tuple(a for a in args if not (isinstance(a, torch.Tensor) and a.is_leaf
                                                                              and a.requires_grad)))

            self._mod_tracker._fw_pre_hook = without_parameters  # read when the tracker is entered

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
