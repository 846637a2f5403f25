"""What a micro-batch's loss is, what the loss is normalised by, and what evaluation reports.

The loop asks an objective for the *sum* of a micro-batch's losses
and divides by the global count (summed over ranks once per step), so the gradient does not
depend on how the global batch was split:

* :class:`CausalLM`: next-token cross-entropy summed over tokens; count = label tokens.
* :class:`CTC`: CTC loss (Graves et al. 2006) summed over utterances; count = transcript
  characters, so the step's loss is nats per character whatever the micro-batches held.
  Evaluation adds greedy CTC decoding and word/character error rates (jiwer).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from memtrain.levers.chunked_cross_entropy import cross_entropy_sum, labels_for_head
from memtrain.data import IGNORE_INDEX
from memtrain.data.speech import decode_ids
from memtrain.errors import ConfigError
from memtrain.models import logits_of


def count_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Number of valid label positions (labels != -100), as a float64 scalar tensor."""
    return (batch["labels"] != IGNORE_INDEX).sum().to(torch.float64)


class Objective(Protocol):
    """A training objective.

    Attributes:
        unit: what :meth:`count` counts (``tokens``, ``characters``), for messages.
        eval_metrics: names of the extra evaluation metrics (recorded as ``val_<name>``).
    """

    unit: str
    eval_metrics: tuple[str, ...]

    def loss_sum(self, model: nn.Module, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed loss of one micro-batch: fp32 (fp64 for a float64 model) scalar, nats."""

    def count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Normalisation count of a batch: float64 scalar."""

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> list[float]:
        """Sums over one evaluation batch, added up over batches and ranks: the loss sum, the
        count, then numerator and denominator of each extra metric."""

    def finish(self, sums: list[float]) -> dict[str, float]:
        """``loss`` (per unit) and the extra metrics from the global :meth:`eval_sums` totals."""


class CausalLM:
    """Next-token prediction: ``input_ids`` int64 [B, T] → logits [B, T, V]; labels int64 [B, T].

    Args:
        chunked: the model's output layer computes the loss in chunks of tokens
            (:mod:`memtrain.levers.chunked_cross_entropy`, ``memory.chunked_cross_entropy``).
        no_cache: call the model with ``use_cache=False`` (a transformers model whose config keeps
            a KV cache: training needs none, and under activation checkpointing transformers
            would warn that it drops it).
    """

    unit = "tokens"
    eval_metrics: tuple[str, ...] = ()

    def __init__(self, chunked: bool = False, no_cache: bool = False):
        self.chunked = chunked
        self.forward_kwargs = {"use_cache": False} if no_cache else {}

    def loss_sum(self, model, micro_batch):
        labels = micro_batch["labels"]
        with labels_for_head(labels) if self.chunked else contextlib.nullcontext() as call:
            out = logits_of(model(input_ids=micro_batch["input_ids"], **self.forward_kwargs))
        if call is not None and call.used:  # the chunked output layer returned the summed loss
            return out
        return cross_entropy_sum(out.flatten(0, 1), labels.flatten())

    def count(self, batch):
        return count_labels(batch)

    def eval_sums(self, model, batch):
        return [float(self.loss_sum(model, batch)), float(self.count(batch))]

    def finish(self, sums):
        return {"loss": sums[0] / max(sums[1], 1.0)}


def trim(micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cut a padded speech micro-batch to its own longest utterance and transcript (a micro-batch
    cut from a longest-first rank batch is padded to the rank's longest otherwise). A batch of
    fake tensors (the planner's trace, where lengths are not known) is kept whole: an upper bound."""
    if is_fake(micro_batch["attention_mask"]):
        return dict(micro_batch)
    frames = int(micro_batch["attention_mask"].sum(1).max())
    chars = int((micro_batch["labels"] != IGNORE_INDEX).sum(1).max())
    return {"input_values": micro_batch["input_values"][:, :frames],
            "attention_mask": micro_batch["attention_mask"][:, :frames],
            "labels": micro_batch["labels"][:, :max(chars, 1)]}


class CTC:
    """Connectionist temporal classification for a transformers ``*ForCTC`` model.

    Args:
        model: the unwrapped model (its ``_get_feat_extract_output_lengths`` maps waveform
            samples to encoder frames).
        blank: id of the CTC blank (``pad_token_id``).
    """

    unit = "characters"
    eval_metrics = ("wer", "cer")

    def __init__(self, model: nn.Module, blank: int = 0):
        self.output_lengths = model._get_feat_extract_output_lengths
        self.blank = blank

    def _log_probs(self, model, mb):
        values = mb["input_values"]
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), values.dtype)
        if dtype in (torch.bfloat16, torch.float16):  # parameters held in 16 bits (DeepSpeed's bf16/fp16,
            values = values.to(dtype)  # FSDP2's optimizer offload), which cast no keyword input
        logits = logits_of(model(input_values=values, attention_mask=mb["attention_mask"]))
        frames = self.output_lengths(mb["attention_mask"].sum(-1)).to(torch.int64)
        if logits.dtype in (torch.float16, torch.bfloat16):  # CTC's forward-backward in half precision loses digits
            logits = logits.float()
        return F.log_softmax(logits, dim=-1), frames

    def loss_sum(self, model, micro_batch):
        """Summed CTC loss (nats) of the micro-batch's utterances; an utterance too short for its
        transcript contributes 0 (``zero_infinity``) instead of an infinite loss."""
        mb = trim(micro_batch)
        return self._ctc(mb, *self._log_probs(model, mb))

    def _ctc(self, mb, log_probs, frames):
        # padded targets [B, S] (the positions past each length unread): the same loss and gradients
        # as the concatenated ones, and shapes the planner's trace can know
        valid = mb["labels"] != IGNORE_INDEX
        return F.ctc_loss(log_probs.transpose(0, 1), mb["labels"].clamp(min=0), frames, valid.sum(-1),
                          blank=self.blank, reduction="sum", zero_infinity=True)

    def count(self, batch):
        return count_labels(batch)

    def decode(self, log_probs: torch.Tensor, frames: torch.Tensor) -> list[str]:
        """Greedy CTC decoding: best class per frame, repeats collapsed, blanks removed.

        Args:
            log_probs: [B, T, V]; frames: int64 [B] valid frames per utterance.

        Returns:
            B transcripts.
        """
        best = log_probs.argmax(-1).cpu()
        out = []
        for row, n in zip(best, frames.tolist()):
            ids = torch.unique_consecutive(row[:n]).tolist()
            out.append(decode_ids(i for i in ids if i != self.blank))
        return out

    def eval_sums(self, model, batch):
        """CTC loss sum, characters, word errors, reference words, character errors, reference
        characters (jiwer's alignment: errors = substitutions + deletions + insertions)."""
        import jiwer

        mb = trim(batch)
        log_probs, frames = self._log_probs(model, mb)
        loss = self._ctc(mb, log_probs, frames)
        hyps = self.decode(log_probs, frames)
        refs = [decode_ids(row[row != IGNORE_INDEX].tolist()) for row in mb["labels"].cpu()]
        words = jiwer.process_words(refs, hyps)
        chars = jiwer.process_characters(refs, hyps)
        return [float(loss), float(count_labels(mb)),
                float(words.substitutions + words.deletions + words.insertions),
                float(words.substitutions + words.deletions + words.hits),
                float(chars.substitutions + chars.deletions + chars.insertions),
                float(chars.substitutions + chars.deletions + chars.hits)]

    def finish(self, sums):
        return {"loss": sums[0] / max(sums[1], 1.0), "wer": sums[2] / max(sums[3], 1.0),
                "cer": sums[4] / max(sums[5], 1.0)}


def make_objective(model: nn.Module, corpus) -> Objective:
    """The objective for ``corpus`` (``kind`` speech → :class:`CTC`, else :class:`CausalLM`).
    Chunked cross-entropy is a lever switched on the objective afterwards
    (:mod:`memtrain.levers.chunked_cross_entropy`)."""
    if getattr(corpus, "kind", "text") == "speech":
        return CTC(model, blank=int(getattr(getattr(model, "config", None), "pad_token_id", 0) or 0))
    caches = getattr(getattr(model, "config", None), "use_cache", False) is True
    return CausalLM(no_cache=caches and "use_cache" in inspect.signature(model.forward).parameters)


class UserObjective:
    """A user's objective from Python (:class:`memtrain.api.Trainer`), under the loop's contract:
    ``loss_sum(model, micro_batch)`` is the micro-batch's summed loss (a scalar tensor, nats) and
    ``count(batch)`` its normalisation count (how many units the sum is over); each step's loss is
    the global sum divided by the global count, whatever the micro-batch split. Evaluation reports
    the same ratio as ``val_loss``.

    Args:
        loss_sum: ``(model, micro_batch) -> scalar tensor``; ``micro_batch`` is the collated dict of tensors.
        count: ``batch -> number``; None = the number of examples in the batch (the first dimension).
        unit: what ``count`` counts, for ``<unit>_per_s`` in metrics (``samples``, ``tokens``, …).
    """

    eval_metrics: tuple[str, ...] = ()

    def __init__(self, loss_sum, count=None, unit: str = "samples"):
        self._loss_sum, self._count, self.unit = loss_sum, count, unit

    def loss_sum(self, model, micro_batch):
        return self._loss_sum(model, micro_batch)

    def count(self, batch):
        if self._count is None:
            return torch.tensor(float(len(next(iter(batch.values())))), dtype=torch.float64)
        return torch.as_tensor(self._count(batch), dtype=torch.float64)

    def eval_sums(self, model, batch):
        return [float(self.loss_sum(model, batch)), float(self.count(batch))]

    def finish(self, sums):
        return {"loss": sums[0] / max(sums[1], 1.0)}


def as_objective(objective) -> Objective:
    """The user's objective as an :class:`Objective`: one with all of the protocol's members is used
    as it is; one with ``loss_sum`` and ``count`` methods, or a plain ``(model, micro_batch) ->
    loss sum`` function (count: examples), becomes a :class:`UserObjective`.

    Raises:
        memtrain.errors.ConfigError: neither (field ``objective``).
    """
    members = ("loss_sum", "count", "eval_sums", "finish", "unit", "eval_metrics")
    if all(hasattr(objective, m) for m in members):
        return objective
    if hasattr(objective, "loss_sum") and hasattr(objective, "count"):
        return UserObjective(objective.loss_sum, objective.count, getattr(objective, "unit", "samples"))
    if callable(objective):
        return UserObjective(objective)
    raise ConfigError("objective", f"{type(objective).__name__} is neither a (model, micro_batch) -> loss sum function "
                      "nor an object with loss_sum(model, micro_batch) and count(batch)")
