"""Activation offloading as a lever (``memory.activation_offload off|on|auto``): the activations a
training forward saves for backward are kept in host memory until backward. Lossless; its cost
is the copies, measured by the planner's probes on a GPU and charged at
``memory.activation_offload_bandwidth_gb_s`` on a CPU run, whose host is its device. Switchable
between steps: the planner, the OOM recovery and grow-back move it. The declaration
(:class:`ActivationOffload`) and the mechanism (:func:`enable_activation_offload`, below) are this
one module.

Activation offloading: what autograd saves for backward during a model's training forward is
kept in host memory until the backward needs it (``torch.autograd.graph.saved_tensors_hooks``).

Which tensors move: a saved activation of at least :data:`MIN_BYTES` that is not model state (a
parameter, a view of one — ZeRO-3's and FSDP2's gathered weights are parameters too — or
autocast's cast copy of one). A tensor saved by several operators moves once per forward. The
hooks cover the model's forward (entered by a forward pre-hook on the model, left by a forward
hook that runs also when the forward raises); a loss computed outside the model (memtrain's
cross-entropy over the logits, whose log-probabilities chunked cross-entropy removes) keeps its
tensors on the device. Inside a checkpointed block torch's own hooks come first, so with
activation checkpointing on only the checkpoint's inputs move. An in-place change of a tensor
after it was saved is not detected (autograd's version check does not see packed tensors).

- **CUDA**: the tensor is copied into a pinned host buffer on a side stream that waits for the
  forward's stream, so the copy overlaps the next operators (the caching allocator is told the
  device tensor is in use there until the copy ends: ``Tensor.record_stream``); backward waits
  for that copy and copies it back on its own stream. torch's ``save_on_cpu`` makes the same
  copies on the compute stream; the side stream follows Megatron-LM's CPU offloading and
  torchtune's ``OffloadActivations``.
- **One memory** (a CPU run, where the host is the device): nothing is copied. The tensors that
  would move are counted as host bytes by the simulated device (:mod:`memtrain.memory.simulated`)
  and left out of the device count, and the planner charges each step the copies a GPU would
  make, at ``memory.activation_offload_bandwidth_gb_s``.
- **Fake tensors** (the planner's trace): the saved tensor is dropped and an empty one of its
  shape is made in backward, so the trace counts the device bytes a GPU run holds (the reload
  while its operator's backward runs) and :attr:`OffloadHooks.moved_bytes` the copies.

Values are copied exactly, so losses and gradients equal those without offloading.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from memtrain.errors import ConfigError
from memtrain.levers.base import ConfigField, Lever, LeverCost, LeverTarget, PlanFacts, choices_annotation
from memtrain.memory.simulated import counting, storage_key
from memtrain.memory.simulated import unpack as unpack_counted

MIN_BYTES = 1024
"""Smaller saved tensors stay on the device (a copy's fixed cost outweighs its bytes; torchtune's
``OffloadActivations`` uses the same floor)."""


@functools.cache
def _fake_type() -> type:
    from torch._subclasses.fake_tensor import FakeTensor  # imported when first offloading, not with memtrain

    return FakeTensor


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, _fake_type()) or t.device.type == "meta"


def _is_parameter_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dtype cast of a parameter, or a view of one (autocast's copy of a weight,
    transposed for a matmul: model state)."""
    fn = (t._base if t._base is not None else t).grad_fn
    return (fn is not None and fn.name().startswith("ToCopyBackward")
            and any(isinstance(getattr(f, "variable", None), nn.Parameter) for f, _ in fn.next_functions))


class _Moved:
    """What the pack hook hands autograd for a moved tensor: the host copy (CUDA), the tensor
    itself (one memory) or its shape (fake), and the simulated device's host count, if any."""

    __slots__ = ("tensor", "device", "event", "host_count")

    def __init__(self, tensor, device, event=None, host_count=None):
        self.tensor, self.device, self.event, self.host_count = tensor, device, event, host_count


class OffloadHooks:
    """The pack and unpack hooks of one model, and the bytes they moved.

    Attributes:
        moved_bytes: bytes of saved activations moved to the host since the last
            :meth:`take_moved_bytes` (each is copied back once in backward).
    """

    def __init__(self):
        self.moved_bytes = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._contexts: list = []
        # this forward's moves by tensor (each moves once), with a weak reference to its storage:
        # a key whose storage was freed may name a new tensor at the same address
        self._moved: dict[tuple, tuple[weakref.ref, _Moved]] = {}

    def wants(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a tensor autograd saves) moves: an activation of at least :data:`MIN_BYTES`,
        not a parameter, a view of one or autocast's cast copy of one."""
        # a fake parameter is a FakeTensor that isinstance() calls a Parameter; a subclass (DTensor, a
        # quantised tensor) is left alone
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return False
        if type(t) not in (torch.Tensor, _fake_type()):
            return False
        if t.layout != torch.strided or _is_parameter_copy(t):
            return False
        return t.numel() * t.element_size() >= MIN_BYTES

    def pack(self, t: torch.Tensor):
        simulated = counting()
        if not self.wants(t):  # kept on the device, counted as autograd's own saves are
            return simulated.pack(t) if simulated is not None else t
        key = (storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        alive, moved = self._moved.get(key, (None, None))
        if alive is None or alive() is None:  # not moved yet, or a freed storage's address reused
            self.moved_bytes += t.numel() * t.element_size()
            if _is_fake(t):
                moved = _Moved((t.size(), t.dtype), t.device)
            elif t.device.type == "cuda":
                moved = self._copy_to_host(t)
            else:
                moved = _Moved(t.detach(), t.device, host_count=simulated.host(t) if simulated is not None else None)
            self._moved[key] = (weakref.ref(t.untyped_storage()), moved)
        return moved

    def _copy_to_host(self, t: torch.Tensor) -> _Moved:
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(t.device)
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)
        return _Moved(host, t.device, event=stream.record_event())

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, _Moved):
            return unpack_counted(packed)
        if isinstance(packed.tensor, tuple):  # fake: the reload a GPU run makes
            size, dtype = packed.tensor
            return torch.empty(size, dtype=dtype, device=packed.device)
        if packed.event is not None:
            stream = torch.cuda.current_stream(packed.device)
            stream.wait_event(packed.event)
            return packed.tensor.to(packed.device, non_blocking=True)
        return packed.tensor

    def take_moved_bytes(self) -> int:
        """:attr:`moved_bytes`, and start counting again from 0."""
        moved, self.moved_bytes = self.moved_bytes, 0
        return moved

    def _enter(self, module, args) -> None:
        context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        context.__enter__()
        self._contexts.append(context)
        self._moved.clear()

    def _exit(self, module, args, output) -> None:
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)
        self._moved.clear()  # autograd holds what backward needs


def enable_activation_offload(model: nn.Module) -> OffloadHooks:
    """Offload ``model``'s saved activations in every forward from now on (idempotent).

    Args:
        model: the unwrapped model (an engine's wrapping calls it, so its hooks run).

    Returns:
        The model's :class:`OffloadHooks`.
    """
    offload = getattr(model, "_memtrain_activation_offload", None)
    if offload is None:
        offload = OffloadHooks()
        model._memtrain_activation_offload = offload
        model._memtrain_activation_offload_hooks = (
            model.register_forward_pre_hook(offload._enter),
            model.register_forward_hook(offload._exit, always_call=True))
    return offload


def disable_activation_offload(model: nn.Module) -> None:
    """Undo :func:`enable_activation_offload`: saved activations stay on the device again."""
    for handle in getattr(model, "_memtrain_activation_offload_hooks", ()):
        handle.remove()
    model.__dict__.pop("_memtrain_activation_offload_hooks", None)
    model.__dict__.pop("_memtrain_activation_offload", None)


def moved_bytes(model: nn.Module) -> int:
    """Bytes :func:`enable_activation_offload`'s hooks moved to the host since the last call (0
    when offloading is off); the count starts again from 0."""
    offload = getattr(model, "_memtrain_activation_offload", None)
    return offload.take_moved_bytes() if offload is not None else 0


CHOICES = {"off": ("off",), "on": ("on",), "auto": ("off",)}
"""The settings a plan may take for each ``memory.activation_offload``, fastest first (``auto``
without the solver: off)."""
SOLVER_CHOICES = ("off", "on")
"""``auto`` under ``memory.levers auto``."""


class ActivationOffload(Lever):
    """Settings: ``off`` or ``on``."""

    name = "activation_offload"
    column = "offload act"
    config_key = "memory.activation_offload"
    escalate_event = "activation_offload_on"
    config_fields = (
        ConfigField("activation_offload", choices_annotation(CHOICES), "auto",
                    "Saved activations wait for backward in host memory. Lossless (memtrain/levers/activation_offload.py: "
                    "on CUDA copied to pinned memory on a side stream, overlapping compute). auto = off, unless "
                    "memory.levers auto chooses it."),
        ConfigField("activation_offload_bandwidth_gb_s", "float", 25.0,
                    "Copy rate (GB/s) charged for offloaded activations. The planner charges the copies at this rate "
                    "(10^9 bytes/s) where it cannot time them: a CPU run (host and device are one memory) and memtrain "
                    "plan. Default: PCIe 4.0 x16 (31.5 GB/s raw; ~25 GB/s for pinned copies)."))
    auto_words = "activation offload (when memory.activation_offload is auto)"
    by_hand = "on"

    def validate(self, cfg, python: frozenset = frozenset()) -> None:
        if cfg.memory.activation_offload_bandwidth_gb_s <= 0:
            raise ConfigError("memory.activation_offload_bandwidth_gb_s", "must be > 0 (GB/s of host<->device "
                              f"copies), got {cfg.memory.activation_offload_bandwidth_gb_s}")

    def choices(self, cfg, spec) -> tuple:
        value = getattr(cfg.memory, "activation_offload", "off")
        if value == "auto" and getattr(cfg.memory, "levers", "off") == "auto":
            return SOLVER_CHOICES
        return CHOICES[value]

    @staticmethod
    def copy_bytes_per_s(cfg) -> float:
        """The rate host copies are charged at where they are not timed (bytes/s):
        ``memory.activation_offload_bandwidth_gb_s`` × 10^9."""
        return cfg.memory.activation_offload_bandwidth_gb_s * 1e9

    def apply(self, target: LeverTarget, setting) -> None:
        if setting == "on":
            enable_activation_offload(target.model)
        else:
            disable_activation_offload(target.model)

    def cost(self, setting, facts: PlanFacts) -> LeverCost:
        """One micro-batch's offloaded activations wait in pinned host memory; each is copied to
        the host and back (``2 × offloaded_bytes`` per micro-batch), charged at
        ``facts.copy_bytes_per_s`` as if no copy overlapped compute (None: not charged)."""
        if setting != "on":
            return LeverCost()
        rate = facts.copy_bytes_per_s
        copies = facts.gradient_accumulation_steps * 2 * facts.offloaded_bytes / rate if rate else 0.0
        return LeverCost(pinned_host_bytes=facts.offloaded_bytes, seconds=copies)

    def event_for(self, setting) -> str:
        return f"activation_offload_{setting}"

    def events(self) -> tuple[str, ...]:
        return tuple(f"activation_offload_{value}" for value in SOLVER_CHOICES)

    def describe(self, setting) -> str:
        return "+ activation offload" if setting == "on" else ""

    def stop_words(self, setting) -> str:
        return "activation offload" if setting == "on" else ""

    def stop_advice(self, setting, engine) -> str:
        return "" if setting == "on" else "memory.activation_offload on"

    def floor_note(self, setting, choices: tuple) -> str:
        return "" if setting == "on" else "(memory.activation_offload is off)"
