"""Fault injection for tests and benchmarks (the ``faults`` config section): real
``torch.OutOfMemoryError``s raised from inside the model, NaN losses, processes killed after a
step, inside a step or half-way through a checkpoint write, and failing checkpoint writes. The
failures walk the same code paths as real ones; production code only offers the hook points
(:meth:`FaultInjector.forward_context`, :meth:`FaultInjector.after_micro_batch`,
:meth:`FaultInjector.perturb`, :meth:`FaultInjector.after_step`,
:meth:`FaultInjector.after_checkpoint_write`) and reads ``faults.*`` itself only where a fault
changes what it must guard against (``docs/design.md``, the module table). With
``faults.memory_budget_mib`` the OOMs come from a simulated device memory instead
(:mod:`memtrain.memory.simulated`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from contextlib import AbstractContextManager
from typing import Iterable, Optional

import torch
from torch import nn

from memtrain.oom import register_block_hooks
from memtrain.memory.simulated import SimulatedMemory

log = logging.getLogger("memtrain")


def kill(where: str) -> None:
    """End this process at once, the way a preempted or crashed job ends (exit status 137, no
    cleanup, no flushing beyond what is already on disk)."""
    log.warning("memtrain: faults: killing the process %s", where)
    sys.stderr.flush()
    os._exit(137)


class FaultInjector:
    """Injects the failures the ``faults`` section asks for.

    OOMs come from hooks on the model's repeated blocks: a forward pre-hook of the first block
    (``oom_in: forward`` or ``eval``) or a gradient hook on its output (``oom_in: backward``). A
    micro-batch "holds" ``batch × sequence`` tokens of activations; with activation checkpointing
    on, only one block's activations are live at a time, so the injector counts ``tokens / number
    of blocks`` — the saving activation checkpointing really gives.

    Kills and hangs fire once per output folder: before firing, the rank writes a marker
    ``output_dir/faults_fired/NAME.rankR``, so a run that a launcher restarts (``torchrun
    --max-restarts``) resumes past them.

    Args:
        faults: the ``faults`` config section (:class:`memtrain.config.FaultsConfig`).
        rank: this rank.
        output_dir: the run's output folder (for the markers); None = no markers (fire every time).

    Attributes:
        step: the optimizer step being run (set by the loop).
        keeps_one_block: whether a micro-batch keeps one block's activations at a time, so the
            injected OOM counts its tokens ÷ the blocks as held (set by a lever: full activation
            checkpointing).
    """

    def __init__(self, faults, rank: int, output_dir: Optional[str] = None):
        self.faults = faults
        self.rank = rank
        self.marker_dir = os.path.join(output_dir, "faults_fired") if output_dir else None
        self.step = 0
        self.keeps_one_block = False
        self.num_blocks = 1
        self.memory: Optional[SimulatedMemory] = None

    def simulate_memory(self, state_bytes: int, parameters: Iterable[torch.Tensor]) -> None:
        """``faults.memory_budget_mib``: count this rank's simulated device memory from now on
        (``state_bytes``: the engine's model state on this rank)."""
        if self.faults.memory_budget_mib > 0:
            self.memory = SimulatedMemory(int(self.faults.memory_budget_mib * 2**20), state_bytes, parameters,
                                          self.rank)

    def forward_context(self) -> AbstractContextManager:
        """Wraps every training forward: the simulated memory's counting, when on."""
        return self.memory.context() if self.memory is not None else contextlib.nullcontext()

    def start_attempt(self) -> None:
        """Before each attempt of a step: the simulated and the CUDA peak restart (so a step's peak
        is that of the attempt that completed)."""
        if self.memory is not None:
            self.memory.reset_peak()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def perturb(self, rank_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``faults.perturb_sample_at_step``: on ``faults.perturb_rank``, the first sample's token
        ids reversed (a different sample reaches training); otherwise the batch unchanged."""
        f = self.faults
        if f.perturb_sample_at_step != self.step or f.perturb_rank != self.rank or "input_ids" not in rank_batch:
            return rank_batch
        ids = rank_batch["input_ids"].clone()
        ids[0] = ids[0].flip(0)
        return {**rank_batch, "input_ids": ids}

    def _active(self, where: str, tokens: int) -> bool:
        f = self.faults
        if f.oom_above_tokens <= 0 or f.oom_in != where or (f.oom_until_step and self.step > f.oom_until_step):
            return False
        if f.oom_ranks is not None and self.rank not in f.oom_ranks:
            return False
        if f.oom_at_steps is not None and self.step not in f.oom_at_steps:
            return False
        held = tokens / self.num_blocks if self.keeps_one_block else tokens
        return held > f.oom_above_tokens

    def _maybe_oom(self, where: str, shape) -> None:
        if self._active(where, int(shape[0]) * (int(shape[1]) if len(shape) > 2 else 1)):
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected by memtrain faults.oom_above_tokens={self.faults.oom_above_tokens} "
                f"in {where} on rank {self.rank})")

    def _poisoned(self) -> bool:
        f = self.faults
        return f.nan_at_step > 0 and f.nan_at_step <= self.step < f.nan_at_step + f.nan_steps

    @staticmethod
    def _poison(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``faults.nan_at_step``: the block's first floating-point input times NaN, so the loss
        and every gradient upstream of the block become NaN, as a real overflow would."""
        args = list(args)
        for container in (args, kwargs):
            keys = range(len(container)) if isinstance(container, list) else list(container)
            for k in keys:
                if isinstance(container[k], torch.Tensor) and container[k].is_floating_point():
                    container[k] = container[k] * float("nan")
                    return tuple(args), kwargs
        return tuple(args), kwargs

    def install(self, blocks: list[nn.Module]) -> None:
        """Register the hooks on ``blocks`` (in forward order) when an OOM or NaN injection is
        configured. Install after :meth:`memtrain.oom.OOMSync.install`, so an injected OOM is
        raised before the block's agreement point, as a real one inside the block would be."""
        self.num_blocks = max(1, len(blocks))
        f = self.faults
        if not (f.oom_above_tokens > 0 or f.nan_at_step > 0):
            return

        def forward(index, hidden, args, kwargs):
            if index != 0:
                return None
            self._maybe_oom("forward" if torch.is_grad_enabled() else "eval", hidden.shape)
            if torch.is_grad_enabled() and self._poisoned():
                return self._poison(args, kwargs)
            return None

        def backward(index, shape):
            if index == 0:
                self._maybe_oom("backward", shape)

        register_block_hooks(blocks, forward, backward)

    def _fire_once(self, name: str, ranks: Optional[list[int]] = None) -> bool:
        """Whether fault ``name`` fires on this rank now: the rank is in ``ranks`` (None = all) and
        the fault has not fired in this output folder before (its marker is then written)."""
        if ranks is not None and self.rank not in ranks:
            return False
        if self.marker_dir is None:
            return True
        marker = os.path.join(self.marker_dir, f"{name}.rank{self.rank}")
        if os.path.exists(marker):
            return False
        os.makedirs(self.marker_dir, exist_ok=True)
        with open(marker, "w") as fh:
            fh.write(f"fired at step {self.step}\n")
        return True

    def after_micro_batch(self, index: int) -> None:
        """``faults.kill_at_step`` with ``kill_mid_step``: end the process after the first
        micro-batch's backward of that step (in the middle of gradient accumulation).
        ``faults.hang_at_step``: the ranks in ``hang_ranks`` stop there for good (until the
        watchdog, ``backend.timeout_s``, or the launcher ends them)."""
        f = self.faults
        if index != 0:
            return
        if f.kill_mid_step and f.kill_at_step == self.step and self._fire_once(f"kill_at_step_{self.step}", f.kill_ranks):
            kill(f"inside step {self.step}, after micro-batch 1")
        if f.hang_at_step and f.hang_at_step == self.step and self._fire_once(f"hang_at_step_{self.step}", f.hang_ranks):
            log.warning("memtrain: faults: rank %d hangs inside step %d", self.rank, self.step)
            sys.stderr.flush()
            while True:  # a rank stuck outside Python's reach: only a timeout or a kill ends it
                time.sleep(1.0)

    def before_optimizer_step(self) -> None:
        """``faults.oom_in_optimizer_at_step``: an out-of-memory error in the optimizer update, on
        ``faults.oom_ranks``, outside the agreement protocol.

        Raises:
            torch.OutOfMemoryError: at that step, once per output folder.
        """
        f = self.faults
        if f.oom_in_optimizer_at_step == self.step and self._fire_once(f"oom_in_optimizer_at_step_{self.step}",
                                                                        f.oom_ranks):
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by memtrain faults.oom_in_optimizer_at_step="
                                         f"{self.step} on rank {self.rank})")

    def after_step(self) -> None:
        """``faults.kill_at_step``: end the process right after that optimizer step."""
        f = self.faults
        if f.kill_at_step == self.step and not f.kill_mid_step and self._fire_once(f"kill_at_step_{self.step}",
                                                                                   f.kill_ranks):
            kill(f"after step {self.step}")

    def after_checkpoint_write(self, step: int, directory: str) -> None:
        """Called by the checkpointer on every rank once the engine's state of ``step`` is written
        into the temporary ``directory``: ``faults.kill_during_save`` ends the process there (no
        manifest yet); ``faults.save_error_ranks`` makes the write fail with an OSError.

        Raises:
            OSError: this rank is in ``faults.save_error_ranks``.
        """
        f = self.faults
        if f.kill_during_save == step and self._fire_once(f"kill_during_save_{step}"):
            kill(f"half-way through saving step {step}")
        if self.rank in (f.save_error_ranks or []):
            raise OSError(f"faults.save_error_ranks: injected write failure in {directory}")
