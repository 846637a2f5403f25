"""Evaluation on the validation split, with its own OOM-safe micro-batch size."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from memtrain.distributed import ProcessState
from memtrain.errors import ConfigError
from memtrain.eval_metrics import EvalMetrics
from memtrain.models import logits_of
from memtrain.objectives import Objective
from memtrain.oom import AgreedOOM, OOMSync, is_oom
from memtrain.watchdog import progress

log = logging.getLogger("memtrain")


class Evaluator:
    """Mean loss per unit (token or character; nats) over the first ``num_samples`` validation
    samples, the objective's metrics (WER and CER for CTC) and a Python caller's
    (:mod:`memtrain.eval_metrics`). Returns ``{"loss": …, "wer": …, …}``; with several validation
    sets by name (``corpus.validation_sets``) each one's as ``{"<name>_loss": …, "<name>_<metric>": …}``
    in their order, and ``"loss"``: the first set's.

    The samples are cut to a multiple of ``world_size`` and dealt round-robin, so every rank runs
    the same number of forwards (the engines' collectives stay matched). Evaluation has its own
    micro-batch size: an OOM here halves it (all ranks agree after every micro-batch where
    :func:`memtrain.oom.agrees_inside_compute` says so) and never touches the training plan. The
    micro-batch size is saved in checkpoints (``state_dict``).

    Args:
        process: the process state; corpus: the data (its ``validation`` split); objective: the loss.
        num_samples: ``training.eval_samples``; micro_batch_size: the starting evaluation micro-batch.
        sync: the OOM agreement points.
        compute_metrics: a Python caller's ``(outputs, labels) -> {name: value}``
            (:class:`memtrain.eval_metrics.EvalMetrics`); None = none.
        unwrap: the engine's ``model -> the user's module`` (whose forward outputs the metrics read).

    Attributes:
        events: evaluation plan changes not yet written to metrics (the loop drains them).
    """

    def __init__(self, process: ProcessState, corpus, objective: Objective, num_samples: int, micro_batch_size: int,
                 sync: OOMSync, compute_metrics: Optional[Callable] = None,
                 unwrap: Callable[[nn.Module], nn.Module] = lambda m: m):
        self.process, self.objective, self.sync = process, objective, sync
        self.metrics, self.unwrap = EvalMetrics(compute_metrics, tuple(objective.eval_metrics)), unwrap
        named = getattr(corpus, "validation_sets", None) or {"": corpus.validation}
        self.splits: dict[str, tuple[Any, list[int]]] = {}  # name -> (split, this rank's sample indices)
        for name, split in named.items():
            n = min(num_samples, len(split))
            if n - n % process.world_size:  # the same on every rank
                self.splits[name] = (split, list(range(process.rank, n - n % process.world_size, process.world_size)))
            elif len(split) and process.is_main:
                log.warning("memtrain: no evaluation%s: %d validation sample(s) to share among %d ranks (training."
                            "eval_samples %d); give at least one per rank", f" of {name!r}" if name else "", n,
                            process.world_size, num_samples)
        first = next(iter(named))
        self.active = first in self.splits  # the first set gives val_loss
        self.micro_batch_size = micro_batch_size
        self.events: list[dict] = []

    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_batch_size = state["micro_batch_size"]

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, (split, mine) in self.splits.items():
            values = self._evaluate(model, split, mine)
            out.update(values if not name else {f"{name}_{k}": v for k, v in values.items()})
            out.setdefault("loss", values["loss"])  # the first set's
        return out

    def _evaluate(self, model: nn.Module, split, mine: list[int]) -> dict[str, float]:
        totals = self._retrying(model, lambda: self._run(model, split, mine))
        self.process.all_reduce_sum(totals)
        n = 2 + 2 * len(self.objective.eval_metrics)  # the objective's sums, then the caller's metrics'
        return {**self.objective.finish(totals[:n].tolist()), **self.metrics.finish(totals[n:].tolist())}

    @torch.no_grad()
    def predict(self, model: nn.Module, split) -> list[torch.Tensor]:
        """The model's outputs for every example of ``split`` (an
        :class:`memtrain.data.examples.ExampleDataset`): the objective's forward of each
        micro-batch as evaluation runs it (its OOM halving too), the output captured by a forward
        hook on the unwrapped module (:func:`memtrain.models.logits_of`). The examples are dealt
        round-robin, the last repeated so every rank runs as many forwards (ZeRO-3's gathers stay
        matched), and gathered on every rank.

        Returns:
            One CPU tensor per example in ``split``'s order: its row of the logits.

        Raises:
            ConfigError: ``split`` is empty (field ``dataset``); the forward's output has no logits.
        """
        n, w = len(split), self.process.world_size
        if n == 0:
            raise ConfigError("dataset", "has no examples to predict")
        mine = [min(i, n - 1) for i in range(self.process.rank, n + (-n) % w, w)]
        rows = self._retrying(model, lambda: self._outputs(model, split, mine))
        gathered = {i: row for part in self.process.all_gather_object(rows) for i, row in part}
        return [gathered[i] for i in range(n)]

    def _outputs(self, model: nn.Module, split, mine: list[int]) -> list[tuple[int, torch.Tensor]]:
        """``(index, output row)`` of each of this rank's examples ``mine``."""
        rows, kept = [], []
        handle = self.unwrap(model).register_forward_hook(lambda module, args, output: kept.append(logits_of(output)))
        try:
            for ids, batch in self._micro_batches(split, mine, "prediction of examples"):
                kept.clear()
                self.objective.eval_sums(model, batch)
                rows += zip(ids, kept[-1].detach().float().cpu().unbind(0))
        finally:
            handle.remove()
        return rows

    def _micro_batches(self, split, mine: list[int], what: str):
        """``(indices, batch on the device)`` of each evaluation micro-batch of ``split``'s samples
        ``mine``, each followed by the OOM agreement point of a forward (every rank makes as many)."""
        for i in range(0, len(mine), self.micro_batch_size):
            ids = mine[i:i + self.micro_batch_size]
            progress(f"{what} {i + 1}-{i + len(ids)} of {len(mine)}")
            yield ids, {k: v.to(self.process.device) for k, v in split.batch(ids).items()}
            self.sync.compute_point()

    def _retrying(self, model: nn.Module, run: Callable[[], Any]):
        """``run()`` in eval mode, its micro-batch halved after an out-of-memory error every rank
        agrees on, until it succeeds (or fails at micro-batch 1)."""
        was_training = model.training
        model.eval()
        try:
            while True:
                try:
                    return run()
                except BaseException as exc:
                    if not self.sync.enabled or not is_oom(exc) or self.micro_batch_size == 1:
                        raise
                    agreed = exc.ranks if isinstance(exc, AgreedOOM) else None
                # outside the except block: the traceback (and the activations its frames hold) is freed
                self._shrink(agreed if agreed is not None else self.sync.agree(True))
        finally:
            model.train(was_training)

    def _shrink(self, ranks: list[int]) -> None:
        if self.process.device.type == "cuda":
            torch.cuda.empty_cache()
        old, self.micro_batch_size = self.micro_batch_size, self.micro_batch_size // 2
        self.events.append({"event": "eval_oom_shrink", "old": old, "new": self.micro_batch_size,
                            "ranks": ranks, "reason": "out of memory in evaluation"})
        if self.process.is_main:  # agreed by every rank
            log.warning("memtrain: OOM in evaluation on rank(s) %s; evaluation micro-batch %d → %d", ranks, old,
                        self.micro_batch_size)

    def _run(self, model: nn.Module, split, mine: list[int]) -> torch.Tensor:
        totals = None  # every rank evaluates at least one micro-batch (the split is in self.splits)
        with self.metrics.capturing(self.unwrap(model)):
            for _, batch in self._micro_batches(split, mine, "evaluation of validation samples"):
                sums = list(self.objective.eval_sums(model, batch))
                if self.metrics.active:
                    sums += self.metrics.sums(batch)
                part = torch.tensor(sums, dtype=torch.float64, device=self.process.device)
                totals = part if totals is None else totals + part
        return totals
