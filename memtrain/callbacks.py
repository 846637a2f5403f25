"""The user's code at a run's moments: :class:`TrainerCallback` (``memtrain.Trainer(...,
callbacks=[...])``), each hook given a read-only :class:`TrainerState`.

Every rank runs every hook at the same moment, then the ranks agree once (one gather, only in a
run with callbacks) on what the hooks did: a ``state.should_stop`` set on any rank ends the run
after that step on every rank, with a checkpoint of it, as a stop signal does (exit 0; a rerun
resumes at the next step); an exception raised on any rank stops every rank with
:class:`CallbackError`, which names the callback, the hook and the rank. The hooks and their
names follow transformers' ``TrainerCallback`` and Lightning's ``Callback``; the stop follows
transformers' ``control.should_training_stop``.
"""

from __future__ import annotations

import math
import types
from typing import Any, Optional, Sequence

class CallbackError(RuntimeError):
    """A callback raised: every rank stops; the message names the callback, the hook, the rank and
    the exception (the command line has no callbacks: Python only)."""


class TrainerState:
    """What a hook sees, read-only but for :attr:`should_stop`.

    Attributes:
        step: optimizer steps done (0 before the first).
        epoch: the data epoch of the last step (0-based).
        plan: ``{"micro_batch_size", "gradient_accumulation_steps", "levers"}`` of the plan in use.
        record: the last step's record as written to ``metrics.jsonl`` (a read-only mapping; empty
            before the first step).
        metrics: the last evaluation's metrics (``{"val_loss": …}``; read-only, empty before one).
        should_stop: set True to end the run after this step (a checkpoint of it, exit 0).
    """

    def __init__(self, step: int, epoch: int, plan: dict, record: Optional[dict] = None,
                 metrics: Optional[dict] = None):
        self._step, self._epoch = step, epoch
        self._plan = types.MappingProxyType(dict(plan))
        self._record = types.MappingProxyType(dict(record or {}))
        self._metrics = types.MappingProxyType(dict(metrics or {}))
        self.should_stop = False

    @classmethod
    def of(cls, step: int, epoch: int, plan, record: Optional[dict], metrics: Optional[dict]) -> "TrainerState":
        """The state a hook sees of a run at ``step`` whose plan in use is ``plan`` (a :class:`memtrain.plan.Plan`)."""
        return cls(step, epoch, {"micro_batch_size": plan.micro_batch_size,
                                 "gradient_accumulation_steps": plan.gradient_accumulation_steps,
                                 "levers": dict(plan.levers)}, record, metrics)

    step = property(lambda self: self._step)
    epoch = property(lambda self: self._epoch)
    plan = property(lambda self: self._plan)
    record = property(lambda self: self._record)
    metrics = property(lambda self: self._metrics)


class TrainerCallback:
    """Subclass and override the hooks wanted; each runs on every rank (``state``: :class:`TrainerState`)."""

    def on_train_begin(self, state: TrainerState) -> None:
        """Before the first step of this session (after a resume: before the first resumed step)."""

    def on_step_end(self, state: TrainerState) -> None:
        """After each optimizer step, its record (and evaluation, if due) in ``state``."""

    def on_evaluate(self, state: TrainerState, metrics: dict[str, float]) -> None:
        """After each evaluation during training (``metrics``: ``{"val_loss": …}``)."""

    def on_save(self, state: TrainerState, path: str) -> None:
        """After a checkpoint of ``state.step`` was written to ``path``."""

    def on_train_end(self, state: TrainerState) -> None:
        """After the last step (and the export) of this session, or the step a stop ended."""


class EarlyStopping(TrainerCallback):
    """Stop when ``metric`` has not improved by more than ``min_delta`` for ``patience``
    evaluations in a row (transformers' ``EarlyStoppingCallback``, Lightning's ``EarlyStopping``).

    Args:
        metric: an evaluation metric (``val_loss``, or ``val_<name>`` of a metrics function).
        patience: evaluations without improvement before the stop, ≥ 1.
        min_delta: the least change that counts as an improvement, ≥ 0.
        mode: ``min`` (a loss) or ``max`` (an accuracy).

    Raises:
        ValueError: ``patience`` < 1, ``min_delta`` < 0 or ``mode`` not ``min``/``max``.
    """

    def __init__(self, metric: str = "val_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min"):
        if patience < 1 or min_delta < 0 or mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping: patience {patience} must be >= 1, min_delta {min_delta} >= 0, "
                             f"mode {mode!r} 'min' or 'max'")
        self.metric, self.patience, self.min_delta, self.mode = metric, patience, min_delta, mode
        self.best, self.bad_evaluations = math.inf if mode == "min" else -math.inf, 0

    def on_evaluate(self, state: TrainerState, metrics: dict[str, float]) -> None:
        if self.metric not in metrics:
            raise KeyError(f"EarlyStopping: no metric {self.metric!r} in the evaluation's {sorted(metrics)}")
        value = metrics[self.metric]
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        self.best, self.bad_evaluations = (value, 0) if better else (self.best, self.bad_evaluations + 1)
        if self.bad_evaluations >= self.patience:
            state.should_stop = True


HOOKS = tuple(name for name in vars(TrainerCallback) if name.startswith("on_"))
"""The hooks memtrain calls, in a run's order."""
PEER_HOOKS = {"on_fit_start": "on_train_begin", "on_train_start": "on_train_begin", "on_fit_end": "on_train_end",
              "on_train_batch_end": "on_step_end", "on_validation_end": "on_evaluate",
              "on_validation_epoch_end": "on_evaluate", "on_save_checkpoint": "on_save", "on_log": "on_step_end",
              "on_batch_end": "on_step_end", "on_epoch_end": "on_step_end (state.epoch)", "on_train_epoch_end": "on_step_end (state.epoch)"}
"""Lightning's ``Callback`` and transformers' ``TrainerCallback`` hooks memtrain has under another
name → that name."""


def unknown_hooks(callback: TrainerCallback) -> list[str]:
    """The methods of ``callback``'s own classes (memtrain callback classes: not a base class of
    another library's) that look meant as a hook memtrain never calls: another trainer's hook
    (:data:`PEER_HOOKS`) or a near-miss of one of :data:`HOOKS` — each with the hook meant, e.g.
    ``on_validation_end (memtrain calls on_evaluate)``. Attributes are read without running them
    (a property is not called); a helper such as ``on_rank_zero`` is no hook's near-miss."""
    import difflib
    import inspect

    out = []
    for cls in type(callback).__mro__:
        if cls is TrainerCallback or not issubclass(cls, TrainerCallback):
            continue
        for name, attr in vars(cls).items():
            if not name.startswith("on_") or name in HOOKS or not isinstance(attr, (types.FunctionType, staticmethod,
                                                                                   classmethod)):
                continue
            meant = PEER_HOOKS.get(name) or next(iter(difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.8)), None)
            if meant and f"{name} (memtrain calls {meant})" not in out:
                out.append(f"{name} (memtrain calls {meant})")
    return out


class Callbacks:
    """The run's callbacks (empty: nothing is called and nothing agreed).

    Raises:
        TypeError: an item is not a :class:`TrainerCallback`.
        ValueError: a callback defines an ``on_*`` method memtrain never calls (a misspelt hook,
            or another trainer's name for one: :func:`unknown_hooks`), which would never run.
    """

    def __init__(self, callbacks: Sequence[TrainerCallback] = ()):
        for cb in callbacks:
            if not isinstance(cb, TrainerCallback):
                raise TypeError(f"callbacks: {cb!r} is not a memtrain.TrainerCallback")
            unknown = unknown_hooks(cb)
            if unknown:
                raise ValueError(f"{type(cb).__name__} defines {', '.join(unknown)}, which memtrain never calls, so "
                                 f"it would never run; the hooks are {', '.join(HOOKS)}")
        self.callbacks = list(callbacks)

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, state: TrainerState, *args: Any, process=None) -> bool:
        """Run ``hook`` of every callback on this rank, then agree with the other ranks (``process``:
        :class:`memtrain.distributed.ProcessState`; None = this rank alone). Returns whether any
        rank's state asked to stop.

        Raises:
            CallbackError: a callback raised on some rank (every rank raises it, naming that one).
        """
        if not self.callbacks:
            return False
        error = None
        for cb in self.callbacks:
            try:
                getattr(cb, hook)(state, *args)
            except Exception as exc:  # noqa: BLE001 — every rank must learn of it, or the others wait
                error = f"callback {type(cb).__name__}.{hook} raised {type(exc).__name__}: {exc}"
                break
        if process is None or process.world_size == 1:
            if error is not None:
                raise CallbackError(error)
            return state.should_stop
        outcomes = process.all_gather_object((error, bool(state.should_stop)))  # one collective
        failed = [(rank, e) for rank, (e, _) in enumerate(outcomes) if e is not None]
        if failed:
            raise CallbackError(f"{failed[0][1]} (rank {failed[0][0]})")
        return any(stop for _, stop in outcomes)
