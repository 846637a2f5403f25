"""A simulated device memory for CPU runs (``faults.memory_budget_mib``): out-of-memory errors that
follow from what the run really holds, not from a rule.

The count on a rank is the bytes of model state the engine holds there (parameters, gradients,
optimizer state, by the engine's own accounting: ``Backend.model_state_bytes``) plus the bytes
autograd saves for backward, counted with ``torch.autograd.graph.saved_tensors_hooks`` as they are
saved (each storage once; parameters are not counted twice) and released when autograd frees
them. A save that would take the count past the budget raises a real ``torch.OutOfMemoryError``,
which takes the same path as a CUDA one. Activation checkpointing lowers the count because inside
a checkpointed region torch keeps nothing for backward; under selective checkpointing the outputs
the policy keeps (:mod:`memtrain.levers.activation_checkpointing`) are counted from the moment they are kept until
their storage is freed. Activations the offload lever moves to host memory
(:mod:`memtrain.levers.activation_offload`) are counted as host bytes instead (:attr:`SimulatedMemory.host_bytes`),
from the save until autograd frees them. Not counted: transient tensors that are
never saved for backward (a block's intermediate results between two saves, the recompute inside
a checkpointed block during backward, communication buffers).
"""

from __future__ import annotations

import contextlib
import weakref
from contextlib import AbstractContextManager
from typing import Iterable, Optional

import torch
from torch.utils._pytree import tree_flatten

_COUNTING: list["SimulatedMemory"] = []  # the simulated memories whose context() is open, innermost last


def note_kept(out) -> None:
    """Count the tensors of ``out`` (an operator's output a selective-checkpoint policy keeps for
    backward outside autograd's saved tensors) on the simulated memory counting now, if any.

    Raises:
        torch.OutOfMemoryError: keeping them passes the simulated budget.
    """
    if _COUNTING:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                _COUNTING[-1].keep(t)


def counting() -> Optional["SimulatedMemory"]:
    """The simulated memory counting now (the innermost open :meth:`SimulatedMemory.context`), or None."""
    return _COUNTING[-1] if _COUNTING else None


def unpack(packed):
    """A saved tensor back from what :meth:`SimulatedMemory.pack` (or no counter) handed autograd."""
    return packed.tensor if isinstance(packed, _Saved) else packed


def storage_key(t: torch.Tensor) -> int:
    """An identity for the storage behind ``t`` (also for meta and fake tensors, whose data
    pointers are all 0)."""
    return t.untyped_storage()._cdata


class _Saved:
    """What the pack hook hands autograd: the tensor, and a release of its bytes when freed."""

    __slots__ = ("tensor", "memory", "key", "host")

    def __init__(self, tensor: Optional[torch.Tensor], memory: "SimulatedMemory", key: int, host: bool = False):
        self.tensor, self.memory, self.key, self.host = tensor, memory, key, host

    def __del__(self):
        self.memory._release(self.key, self.host)


class SimulatedMemory:
    """Counts a rank's simulated device memory and raises OOM past the budget.

    Args:
        budget_bytes: the simulated device's capacity.
        state_bytes: model state the engine holds on this rank (bytes, constant over the run).
        parameters: the model's parameters (their storages are model state, not saved activations).
        rank: this rank (for the message).

    Attributes:
        saved_bytes: bytes saved for backward and not yet freed.
        peak_bytes: the largest ``state_bytes + saved_bytes`` since :meth:`reset_peak`.
        host_bytes, host_peak_bytes: bytes of saved activations offloaded to host memory
            (:meth:`host`) and not yet freed; their largest since :meth:`reset_peak`.
    """

    def __init__(self, budget_bytes: int, state_bytes: int, parameters: Iterable[torch.Tensor], rank: int = 0):
        self.budget_bytes, self.state_bytes, self.rank = budget_bytes, state_bytes, rank
        self._parameters = list(parameters)
        self._parameter_keys: set[int] = set()
        self._parameter_storages: list[torch.UntypedStorage] = []
        self._live: dict[int, list[int]] = {}  # storage key → [references held by autograd, bytes]
        self._host: dict[int, list[int]] = {}  # the same for offloaded activations
        self.saved_bytes = self.host_bytes = self.host_peak_bytes = 0
        self.peak_bytes = state_bytes

    def reset_peak(self) -> None:
        """Start a new peak measurement (the loop calls it at every step)."""
        self.peak_bytes = self.state_bytes + self.saved_bytes
        self.host_peak_bytes = self.host_bytes

    def context(self) -> AbstractContextManager:
        """Count what autograd saves inside the ``with`` block (a training forward)."""
        # current storages: sharding engines free and replace them. They are held until the next
        # forward: a freed storage's address is reused, e.g. by the logits, which would then pass
        # for a parameter and go uncounted.
        self._parameter_storages = [getattr(p, "_local_tensor", p).untyped_storage() for p in self._parameters]
        self._parameter_keys = {s._cdata for s in self._parameter_storages}
        return self._counting()

    @contextlib.contextmanager
    def _counting(self):
        _COUNTING.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, unpack):
                yield
        finally:
            _COUNTING.remove(self)

    def keep(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until it is freed (an output kept outside autograd's saved tensors)."""
        key = self._count(t)
        if key is not None:
            weakref.finalize(t.untyped_storage(), self._release, key)

    def host(self, t: torch.Tensor) -> "_Saved":
        """Count ``t``'s storage as host memory (an activation the offload lever moved) until the
        returned handle is freed."""
        key = storage_key(t)
        entry = self._host.get(key)
        if entry is None:
            entry = self._host[key] = [0, t.untyped_storage().nbytes()]
            self.host_bytes += entry[1]
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        entry[0] += 1
        return _Saved(None, self, key, host=True)

    def pack(self, t: torch.Tensor):
        """The pack hook: count ``t`` (unless it is model state) and hand autograd a handle that
        releases its bytes when freed.

        Raises:
            torch.OutOfMemoryError: its bytes pass the budget.
        """
        key = self._count(t)
        # detached: a saved output holding its own grad_fn would make a cycle autograd never frees
        return t if key is None else _Saved(t.detach(), self, key)

    def _count(self, t: torch.Tensor):
        """Add a reference to ``t``'s storage (its bytes on the first); None for model state.
        Raises torch.OutOfMemoryError past the budget."""
        key = storage_key(t)
        # a parameter (or a view of one, e.g. a transposed weight) is model state; ZeRO-3 and FSDP2
        # gather parameters into new storages during forward, which are still Parameters
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or key in self._parameter_keys:
            return None
        entry = self._live.get(key)
        if entry is None:
            size = t.untyped_storage().nbytes()
            total = self.state_bytes + self.saved_bytes + size
            if total > self.budget_bytes:
                raise torch.OutOfMemoryError(
                    f"out of memory in forward on the simulated device of faults.memory_budget_mib (rank {self.rank}): "
                    f"{total / 2**20:.3f} MiB needed ({self.state_bytes / 2**20:.3f} MiB model state + "
                    f"{(self.saved_bytes + size) / 2**20:.3f} MiB kept by autograd), "
                    f"{self.budget_bytes / 2**20:.3f} MiB budget")
            entry = self._live[key] = [0, size]
            self.saved_bytes += size
            self.peak_bytes = max(self.peak_bytes, total)
        entry[0] += 1
        return key

    def _release(self, key: int, host: bool = False) -> None:
        live = self._host if host else self._live
        entry = live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            if host:
                self.host_bytes -= entry[1]
            else:
                self.saved_bytes -= entry[1]
            del live[key]
