"""Nobody waits for ever: what this rank is doing, and a watchdog that ends the rank when one
operation of the loop takes longer than ``backend.timeout_s``.

The other half of the guarantee is the process group's own timeout (set from the same field in
:class:`memtrain.distributed.ProcessState`): a rank waiting in a collective for a rank that hangs
or died gets an error after ``backend.timeout_s`` (gloo; NCCL with async error handling), which
:func:`memtrain.train.cli` reports with the operation named here (exit code
:data:`COLLECTIVE_FAILED`). The watchdog covers the rank that hangs itself, outside any
collective (a stuck file system, a fault's sleep), which no collective timeout can reach. A
launcher with restarts (``torchrun --max-restarts N``) then starts every rank again, and the run
resumes from its last checkpoint.

Only compute with a bound is timed: a micro-batch's forward and backward, the optimizer step, one
evaluation batch. Waits on one rank's long work (building the data cache, committing or
exporting a checkpoint) use a group without a practical timeout
(:meth:`memtrain.distributed.ProcessState.wait_for_main`) and are not timed here.

Source: the same split as PyTorch's NCCL watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) and
torchtitan's ``comm.train_timeout_seconds``: one timeout for collectives, a thread for the rest.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Optional

from memtrain.errors import CollectiveError

log = logging.getLogger("memtrain")

COLLECTIVE_FAILED = 6
"""Exit code of a rank whose collective failed or timed out, or whose watchdog fired."""

_context = ""  # e.g. "step 7"
_operation = "start-up"
_since: Optional[float] = None  # time.monotonic() the timed operation began; None = not timed
_lock = threading.Lock()


def progress(what: str, timed: bool = True, context: Optional[str] = None) -> None:
    """This rank starts ``what`` (a phrase such as ``"micro-batch 2 of 4, forward and backward"``),
    within ``context`` (``"step 7"``; None = the current one, ``""`` = none); with ``timed`` the
    watchdog measures it from now."""
    global _context, _operation, _since
    with _lock:
        _context = _context if context is None else context
        _operation, _since = what, (time.monotonic() if timed else None)


def operation() -> str:
    """What this rank is doing now (the last :func:`progress`), e.g. ``"step 7: micro-batch 2 of
    4, forward and backward"``."""
    return f"{_context}: {_operation}" if _context else _operation


class Watchdog:
    """A daemon thread that ends the process with :data:`COLLECTIVE_FAILED` when a timed
    operation (:func:`progress`) runs longer than ``timeout_s`` seconds, after logging the rank,
    the operation and the time.

    Args:
        timeout_s: seconds one timed operation may take (``backend.timeout_s``).
        rank: this rank (for the message).
    """

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memtrain-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the thread ends within its poll interval)."""
        self._stop.set()

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(interval):
            with _lock:
                since = _since
            what = operation()
            if since is not None and time.monotonic() - since > self.timeout_s:
                log.error("memtrain: rank %d: no progress for %.0f s in %s (backend.timeout_s %g); ending this rank "
                          "(exit %d) so the job does not hang; a launcher with restarts resumes from the last "
                          "checkpoint", self.rank, time.monotonic() - since, what, self.timeout_s, COLLECTIVE_FAILED)
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                os._exit(COLLECTIVE_FAILED)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that timed out or lost its peer (torch's ``DistError``, or the
    ``RuntimeError`` gloo raises: "Timed out waiting … for recv", "Connection closed by peer")."""
    import torch.distributed as dist

    if isinstance(exc, (CollectiveError, getattr(dist, "DistError", ()))):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("gloo/transport", "Timed out waiting", "Connection closed by peer",
                                      "Connection reset by peer", "NCCL", "ProcessGroup"))


def collective_failure_message(exc: BaseException, rank: int, timeout_s: float) -> str:
    """The one-line report of a failed collective: rank, operation, timeout and the cause."""
    if isinstance(exc, CollectiveError):  # said already
        return str(exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"rank {rank}: a collective failed during {operation()}: another rank stopped, died or hung "
            f"(backend.timeout_s {timeout_s:g}); cause: {first[:300]}")
