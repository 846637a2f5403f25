"""Every random stream a run draws from — Python's ``random``, NumPy's global generator, torch's
CPU generator and each CUDA device's — captured and restored by one helper, so the OOM retry
(:mod:`memtrain.step`), the planner's trace (:mod:`memtrain.build`) and checkpoints
(:class:`memtrain.checkpoint.stateful.RNGState`) always cover the same streams.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple, Optional

import numpy as np
import torch


class RandomStreams(NamedTuple):
    """The states of every stream, as their libraries return them (cheap to take: no copies beyond theirs)."""

    python: tuple
    numpy: tuple
    torch: torch.Tensor
    cuda: Optional[list]


def capture() -> RandomStreams:
    """This process's random states now."""
    return RandomStreams(random.getstate(), np.random.get_state(), torch.get_rng_state(),
                         torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def restore(streams: RandomStreams) -> None:
    """Put back what :func:`capture` took (the CUDA states only where CUDA is present)."""
    random.setstate(streams.python)
    np.random.set_state(streams.numpy)
    torch.set_rng_state(streams.torch)
    if streams.cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(streams.cuda)


def to_saveable(streams: RandomStreams) -> dict[str, Any]:
    """``streams`` as data ``torch.load(weights_only=True)`` reads back (NumPy's key array as an int64 tensor)."""
    kind, keys, pos, has_gauss, gauss = streams.numpy
    return {"python": streams.python,
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "gauss": gauss},
            "torch": streams.torch, "cuda": streams.cuda}


def from_saveable(state: dict[str, Any]) -> RandomStreams:
    """The inverse of :func:`to_saveable`."""
    n = state["numpy"]
    return RandomStreams(state["python"], (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                                           n["gauss"]), state["torch"], state["cuda"])
