"""Python's cyclic garbage collector, run by the loop at step boundaries instead of whenever the
allocation counters say so.

Left automatic, the collector runs in the middle of steps: a young-generation pass every few
hundred allocations and, every so often, a full pass over every object the process holds. In a
training process that imported transformers, datasets and an engine, a full pass took 100–116 ms
on the project's 2-core CPU machine (about one and a half steps of the benchmark model), and the
young passes about 1 ms per step; each rank pauses at a different moment, and the others wait for
it at the next collective or agreement point. With ``training.gc_every_steps`` N > 0 the loop
turns the automatic collector off and runs a young-generation pass (generations 0 and 1) after
every N-th step, on every rank at the same step. Reference cycles made during a step are freed
at the next such pass; the OOM protocol still runs a full collection after a failed attempt
(:func:`memtrain.step.step_with_recovery`).

Source: torchtitan's ``GarbageCollection`` (``training.gc_freq``, default 50), OLMo-core's
``GarbageCollectorCallback`` and Megatron-LM's ``--manual-gc`` do the same.
"""

from __future__ import annotations

import gc


class StepCollector:
    """The garbage collector's schedule for one run (a context manager around the loop).

    Args:
        every_steps: run a generation-1 collection after every this many optimizer steps; 0 =
            leave Python's automatic collector as it is.

    Attributes:
        collections: the collections this object ran (for tests and benchmarks).
    """

    def __init__(self, every_steps: int):
        if every_steps < 0:
            raise ValueError(f"every_steps must be >= 0, got {every_steps}")
        self.every_steps = every_steps
        self.collections = 0
        self._was_enabled = None  # the automatic collector's state before __enter__

    def start(self) -> None:
        """Turn the automatic collector off (when ``every_steps`` > 0) and empty the young
        generations once."""
        if self.every_steps and self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect()

    def __enter__(self) -> "StepCollector":
        self.start()
        return self

    def after_step(self, step: int) -> None:
        """Called by every rank after optimizer step ``step`` (1-based)."""
        if self.every_steps and step % self.every_steps == 0:
            self._collect()

    def _collect(self) -> None:
        gc.collect(1)
        self.collections += 1

    def stop(self) -> None:
        """Give the automatic collector back its state from before :meth:`start`."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def __exit__(self, *exc) -> None:
        self.stop()
