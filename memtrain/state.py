"""The loop's own counters, as one :class:`~memtrain.checkpoint.stateful.Stateful` entry."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class TrainState:
    """Where training stands after the last completed optimizer step.

    Attributes:
        step: optimizer steps completed.
        epoch: the data epoch of the last step (0-based).
        samples_seen: samples trained on, over all ranks (``step × global_batch_size``).
        targets_seen: loss targets trained on, over all ranks: label tokens for a language model,
            transcript characters for CTC (the objective's unit).
        first_loss, last_loss: training loss of the first and the last step (for the summary).
        initial_val_loss: validation loss before step 1; val_loss: the latest validation loss.
    """

    step: int = 0
    epoch: int = 0
    samples_seen: int = 0
    targets_seen: int = 0
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    initial_val_loss: Optional[float] = None
    val_loss: Optional[float] = None

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, state[f.name])
