"""The peak bytes one training micro-step holds beyond model state, traced on fake tensors.

A micro-step's memory above the model state (parameters, gradients, optimizer state; counted by
:mod:`memtrain.memory.accounting`) is more than what autograd saves for backward: at the start
of backward the loss's gradient with respect to the logits sits beside the saved activations,
and each block's backward holds its own temporaries. :func:`step_peak_bytes` runs forward *and*
backward of one micro-batch under ``FakeTensorMode`` (no memory is used) with a dispatch mode
that counts every tensor storage an operator creates until it is freed, and returns the peak.
A parameter's gradient is model state (counted by the accounting, whole, for the whole step)
from the moment autograd hands it to the parameter's hooks.

The count is checked against torch's ``MemTracker`` on real runs of every engine by
``benchmarks/memory_accuracy.py``.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created by operators inside it until they are freed.

    Attributes:
        live_bytes, peak_bytes: bytes now and at most.
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # storage key -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._state: set[int] = set()  # storages that became model state (never counted again)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes or key in self._state:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self.release(key))
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def to_state(self, key: int) -> None:
        """Storage ``key`` is model state from now on (a gradient accumulated into ``.grad``):
        not counted here, also when a later operator returns a view of it."""
        self._state.add(key)
        self.release(key)

    def release(self, key: int) -> None:
        """Stop counting storage ``key`` (freed)."""
        size = self._sizes.pop(key, None)
        self._refs.pop(key, None)
        if size is not None:
            self.live_bytes -= size


def fake_batch(mode, micro_batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``micro_batch`` as fake tensors of ``mode`` on ``device`` (no memory)."""
    return {k: mode.fake_tensor_converter.from_meta_and_device(mode, v.to("meta"), device)
            for k, v in micro_batch.items()}


def step_peak_bytes(model: nn.Module, mode, objective, micro_batch: dict[str, torch.Tensor]) -> int:
    """Peak bytes of one training forward and backward of ``micro_batch`` beyond model state.

    Args:
        model: a fake model (:func:`memtrain.memory.planner.fake_model`, levers applied).
        mode: its ``FakeTensorMode``.
        objective: the run's objective (:mod:`memtrain.objectives`); its ``loss_sum`` is traced.
        micro_batch: tensors [B, …] on any device (made fakes on the model's device here).

    Returns:
        Bytes (saved activations and transients) at the peak.
    """
    counter = _LiveBytes()
    for t in [*model.parameters(), *model.buffers()]:  # model state; views of it (a transposed weight) too
        counter.to_state(t.untyped_storage()._cdata)
    params = [p for p in model.parameters() if p.requires_grad]
    # the gradient autograd hands over, and the copy AccumulateGrad makes of it when its layout
    # differs from the parameter's (a transposed Linear weight's): both are the gradient
    hooks = [p.register_hook(lambda grad: counter.to_state(grad.untyped_storage()._cdata)) for p in params]
    hooks += [p.register_post_accumulate_grad_hook(lambda p: counter.to_state(p.grad.untyped_storage()._cdata))
              for p in params]
    try:
        with mode:
            batch = fake_batch(mode, micro_batch, next(model.parameters()).device)
            with torch.enable_grad(), counter:
                loss = objective.loss_sum(model, batch)
                loss.backward()
                del loss
    finally:
        for hook in hooks:
            hook.remove()
        for p in params:
            p.grad = None
    return counter.peak_bytes
