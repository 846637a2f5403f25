"""A Python caller's evaluation metrics (``Trainer(compute_metrics=fn)``), as transformers'
``compute_metrics`` and Lightning's ``validation_step`` logging give them, without a second
forward and without holding the whole evaluation set's outputs.

``fn(outputs, labels) -> {name: value}`` runs on every rank after each evaluation micro-batch:
``outputs`` is what the model returned in that micro-batch's forward (captured by a forward hook
on the unwrapped model, so the objective's own forward is the only one), ``labels`` the
micro-batch's ``labels`` tensor (as the objective reads them; None when it has none). A value is

- a float: its mean over the evaluation set, each micro-batch weighted by its examples; or
- a pair ``(sum, count)``: the sums over every micro-batch of every rank divided by the counts
  (exact whatever the micro-batch split, e.g. ``(correct_tokens, labelled_tokens)`` for token
  accuracy).

The sums are reduced over ranks with the evaluation loss's own all-reduce; the names are
recorded as ``val_<name>`` beside ``val_loss``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from memtrain.errors import ConfigError


class EvalMetrics:
    """Sums of a ``compute_metrics`` function's values over one evaluation.

    Args:
        compute_metrics: ``(outputs, labels) -> dict[str, float | (float, float)]``; None = none.
        reserved: names the objective records already (``loss``, ``wer``, …), refused as metric names.
    """

    def __init__(self, compute_metrics: Optional[Callable[[Any, Any], dict]], reserved: tuple[str, ...] = ()):
        self.fn, self.reserved = compute_metrics, ("loss",) + tuple(reserved)
        self.names: Optional[list[str]] = None  # fixed by the first micro-batch of the run
        self._outputs: Any = None

    @property
    def active(self) -> bool:
        return self.fn is not None

    @contextlib.contextmanager
    def capturing(self, model: nn.Module):
        """While evaluating: keep the output of each forward of ``model`` (the unwrapped module)."""
        if self.fn is None:
            yield
            return

        def keep(module, args, output):
            self._outputs = output

        handle = model.register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()
            self._outputs = None

    def sums(self, batch: dict[str, torch.Tensor]) -> list[float]:
        """``[value sum, count]`` per metric name (in :attr:`names` order) of the micro-batch just evaluated.

        Raises:
            memtrain.errors.ConfigError: the function returned no dict of numbers or pairs, another
                set of names than before, or a name the objective records (field ``compute_metrics``).
        """
        values = self.fn(self._outputs, batch.get("labels"))
        if not isinstance(values, dict) or not values:
            raise ConfigError("compute_metrics", f"must return a dict of metric name -> float or (sum, count); "
                              f"got {type(values).__name__}")
        if self.names is None:
            taken = sorted(set(values) & set(self.reserved))
            if taken:
                raise ConfigError("compute_metrics", f"metric name(s) {taken} are the objective's (recorded as "
                                  f"val_{taken[0]} already): rename them")
            self.names = sorted(values)
        if sorted(values) != self.names:
            raise ConfigError("compute_metrics", f"returned {sorted(values)} after {self.names}: return the same "
                              "names for every micro-batch")
        examples = len(next(iter(batch.values())))
        out = []
        for name in self.names:
            value = values[name]
            pair = tuple(value) if isinstance(value, (tuple, list)) else (float(value) * examples, examples)
            if len(pair) != 2:
                raise ConfigError("compute_metrics", f"{name}: a float or a (sum, count) pair, got {value!r}")
            out.extend(float(x) for x in pair)
        return out

    def finish(self, sums: list[float]) -> dict[str, float]:
        """``{name: sum / count}`` from the summed :meth:`sums` of every micro-batch and rank (NaN where no count)."""
        return {name: sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else math.nan
                for i, name in enumerate(self.names or [])}
