"""``memtrain`` with a failure that comes from outside the trainer: the script patches
memtrain's functions from here (memtrain itself offers no hook for these).

* ``MEMTRAIN_KILL_AT=WHERE:STEP[:RANK]``: the rank (default 0) sends itself SIGKILL at boundary
  WHERE (one of :data:`BOUNDARIES`) of optimizer step STEP, which ends it at once, as an
  operator's ``kill -9`` or a preempted node does (no cleanup, no ``finally``, no flush of
  Python's buffers).
* ``MEMTRAIN_DISK_FULL_IN=export`` (or ``cache``): the model export's (the data cache's) writes
  fail as on a full disk (``OSError`` ENOSPC, as ``write(2)`` reports it), once it has begun
  writing.

    MEMTRAIN_KILL_AT=commit_to_record:5 python tests/from_outside.py --config ...

Without the variables this is ``memtrain``.
"""

from __future__ import annotations

import os
import signal
import sys

BOUNDARIES = {
    "after_optimizer_step": "the optimizer stepped and the state advanced; no record, no evaluation, no save",
    "in_evaluation": "half-way through the step's evaluation (after its first micro-batch)",
    "save_before_rename": "the checkpoint's files written, its commit begun, the folder not yet renamed",
    "save_after_rename": "the checkpoint folder renamed into place, 'latest' not yet replaced",
    "commit_to_record": "the checkpoint committed, the step's record not yet written",
    "in_record_write": "half of the step's metrics.jsonl line written and flushed",
}
"""The boundaries of a step where a kill can land, and what has happened by then."""


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(where: str, step: int) -> None:
    """Patch memtrain so that this process dies at ``where`` of optimizer step ``step``."""
    import memtrain.checkpoint.layout as layout
    from memtrain.evaluate import Evaluator
    from memtrain.loop import TrainingLoop
    from memtrain.metrics import MetricsLogger

    current = {"step": 0}

    def optimizer_step(self, s, run_start, _orig=TrainingLoop._optimizer_step):
        current["step"] = s
        outcome = _orig(self, s, run_start)
        if where == "after_optimizer_step" and s == step:
            die()
        return outcome

    def run(self, model, *split, _orig=Evaluator._run):
        if where == "in_evaluation" and current["step"] == step:
            inner = self.objective.eval_sums

            def eval_sums(m, batch):
                out = inner(m, batch)
                die()
                return out
            self.objective.eval_sums = eval_sums
        return _orig(self, model, *split)

    def commit(tmp, root, s, *args, _orig=layout.commit, **kwargs):
        if where == "save_before_rename" and s == step:
            die()
        if where == "save_after_rename" and s == step:
            real = layout.os

            class RenameThenDie:  # layout's os, whose rename of the checkpoint folder is its last act
                def __getattr__(self, name):
                    return getattr(real, name)

                @staticmethod
                def replace(src, dst):
                    real.replace(src, dst)
                    if os.path.basename(dst) == layout.step_dir_name(s):
                        die()
            layout.os = RenameThenDie()
        return _orig(tmp, root, s, *args, **kwargs)

    def save_if_due(self, s, preemption, *args, _orig=TrainingLoop._save_if_due):
        stopped = _orig(self, s, preemption, *args)
        if where == "commit_to_record" and s == step:
            die()
        return stopped

    def log_step(self, record, show=True, _orig=MetricsLogger.log_step):
        if where == "in_record_write" and record["step"] == step and self.enabled:
            import json

            line = json.dumps(record) + "\n"
            self._file.write(line[:len(line) // 2])
            self._file.flush()
            die()
        return _orig(self, record, show)

    TrainingLoop._optimizer_step = optimizer_step
    Evaluator._run = run
    layout.commit = commit
    TrainingLoop._save_if_due = save_if_due
    MetricsLogger.log_step = log_step


def fill_disk_in(what: str) -> None:
    """The export's (``what`` = ``export``) or the data cache's (``cache``) writes fail with ENOSPC
    (what ``write(2)`` returns on a full disk), after a part is written."""
    import errno

    def no_room(path: str):
        with open(path, "wb") as fh:
            fh.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if what == "export":
        import memtrain.export as export

        export._write_export = lambda model, state_dict, tmp, *args: no_room(os.path.join(tmp, "model.safetensors"))
    elif what == "cache":
        import memtrain.data.tokens as tokens

        class NumPy:  # the cache module's numpy, whose save finds the disk full
            def __getattr__(self, name):
                return getattr(real, name)

            @staticmethod
            def save(path, arr):
                no_room(path)
        real, tokens.np = tokens.np, NumPy()
    else:
        raise AssertionError(f"MEMTRAIN_DISK_FULL_IN: {what!r} is not export or cache")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.environ.get("MEMTRAIN_DISK_FULL_IN"):
        fill_disk_in(os.environ["MEMTRAIN_DISK_FULL_IN"])
    spec = os.environ.get("MEMTRAIN_KILL_AT")
    if spec:
        where, step, *rank = spec.split(":")
        assert where in BOUNDARIES, f"MEMTRAIN_KILL_AT: {where!r} is not one of {sorted(BOUNDARIES)}"
        if int(os.environ.get("RANK", "0")) == int(rank[0] if rank else 0):
            install(where, int(step))
    from memtrain.train import cli

    cli()
