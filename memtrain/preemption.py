"""Stop signals: finish the step, save, exit (the loop's decision, agreed by every rank)."""

from __future__ import annotations

from typing import Optional


class Preemption:
    """SIGTERM / SIGUSR1 (how SLURM and Kubernetes stop jobs) ask the run to finish its current
    optimizer step, save a checkpoint and exit 0; SIGINT (Ctrl-C) does the same and the run exits
    130. A second SIGINT stops at once (``KeyboardInterrupt``, exit 130): a save it interrupts is
    never committed, so the last complete checkpoint stays the one a rerun resumes from.

    The handler only sets a flag; the loop all-reduces it once per step (in the step's closing
    OOM agreement, :meth:`memtrain.oom.OOMSync.closing_point`, or
    :meth:`memtrain.distributed.ProcessState.any_rank` without OOM recovery), so every rank stops after the same step
    even when the signal reached only some. Previous handlers are restored by :meth:`close`.
    Handlers can be installed from the main thread only; elsewhere this is inert.

    Attributes:
        signal_name: the signal received on this rank (``SIGTERM``), or None.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self):
        import signal
        import threading

        self.signal_name: Optional[str] = None
        self.interrupted = False  # a SIGINT arrived
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        """A stop signal reached this rank."""
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        import signal

        name = signal.Signals(signum).name
        if name == "SIGINT" and self.interrupted:
            raise KeyboardInterrupt("a second Ctrl-C")
        self.interrupted = self.interrupted or name == "SIGINT"
        self.signal_name = self.signal_name or name

    def close(self) -> None:
        """Restore the previous handlers."""
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
