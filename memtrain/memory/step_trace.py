"""The peak bytes one training micro-step holds beyond model state, traced on fake tensors.

A micro-step's memory above the model state (parameters, gradients, optimizer state; counted by
:mod:`memtrain.memory.accounting`) is more than what autograd saves for backward: at the start
of backward the loss's gradient with respect to the logits sits beside the saved activations,
and each block's backward holds its own temporaries. :func:`step_peak_bytes` runs forward *and*
backward of one micro-batch under ``FakeTensorMode`` (no memory is used) with a dispatch mode
that counts every tensor storage an operator creates until it is freed, and returns the peak.
A parameter's gradient is model state (counted by the accounting, whole, for the whole step)
from the moment autograd hands it to the parameter's hooks.

The model traced is :func:`fake_model`'s, holding its parameters as the engine computes with them
(:func:`compute_precision_model`: under Accelerate's autocast fp32 parameters and an autocast
forward, under the sharded engines the compute dtype). The count is checked against torch's
``MemTracker`` on real runs of every engine by ``benchmarks/memory_accuracy.py``.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memtrain.memory.fake_ops import CTC, fused_attention, grouped_mm_in_dtype
from memtrain.models import repeated_blocks


MADE_PEAKS = 14
"""How many peaks ``StepPeaks.made`` holds: four windows of backward with every made element,
with those outside the blocks, with those and the running block's; two at a block's end."""


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created by operators inside it until they are freed.

    Attributes:
        live_bytes, peak_bytes: bytes now and at most.
        in_block_peak_bytes: at most while a repeated block runs (``in_block`` > 0).
        in_backward_peak_bytes: at most from the first parameter gradient on (``in_backward``).
        in_block_backward_peak_bytes: at most while a repeated block runs its backward after
            another block's backward ended (``block_backward_done``).
        in_block_forward_peak_bytes: at most while a repeated block runs its forward
            (``in_block`` > 0 and ``in_forward``: the loss's backward has not begun).
        in_block: how many blocks are running now (forward, or backward; see :func:`_watch_blocks`).
        in_backward: a parameter's gradient has arrived (:meth:`to_gradient`).
        kept_bytes: parameters' bytes autograd keeps through a view it saved (:meth:`keep`).
        pending_bytes: parameters' bytes whose module has not yet run its forward (:meth:`pend`,
            :meth:`claim`): ZeRO-3's copies out of its coalesced prefetch.
        view_peaks: [peak, in_block, in_backward] of the live bytes and ``kept_bytes`` together,
            and [in_block_forward, forward] of those and ``pending_bytes``.
        made_elements, made_outside_elements: elements of the parameters whose gradient has
            arrived (:meth:`arrive`), all of them and those outside the repeated blocks.
        made_running_elements: those of the block whose backward runs now (since the last
            block's backward ended: :meth:`block_ended`).
        made_peaks: from the loss's backward on, the live bytes plus 4 bytes per made element
            at most, in four windows of backward (``StepPeaks.made``): before any block's
            backward, in the first block's, in a later block's, between and after the blocks';
            then the same with 4 bytes per made element outside the blocks alone; then with
            those outside the blocks and in the running block; then, at the moments a block's
            backward ends, with every made element and with those outside and in that block.
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = self.peak_bytes = self.in_block_peak_bytes = self.in_backward_peak_bytes = 0
        self.in_block_backward_peak_bytes = self.in_block_forward_peak_bytes = 0
        self.block_backward_done = False  # a block's backward has ended
        self.in_block, self.in_backward = 0, False
        self.in_forward = True  # until the loss's backward begins (step_peaks)
        self._sizes: dict[int, int] = {}  # storage key -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._state: set[int] = set()  # storages that became model state (never counted again)
        self.kept_bytes = 0  # parameters kept through a saved view (:meth:`keep`)
        self.view_peaks = [0, 0, 0, 0, 0]  # peak, in_block, in_backward of live + kept; in_block_forward, forward of live + kept + pending
        self._kept: dict[int, list[int]] = {}  # parameter storage key -> [saved views alive, bytes]
        self.pending_bytes = 0
        self._pending: dict[int, int] = {}  # parameter storage key -> bytes, until its module's forward ends
        self.made_elements = self.made_outside_elements = self.made_running_elements = 0
        self.made_peaks = [0] * MADE_PEAKS
        self._arrived: set[int] = set()  # ids of the parameters whose gradient has arrived

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16 and is_fake(args[0]):
            out = grouped_mm_in_dtype(func, args, kwargs or {})
        elif func in CTC and is_fake(args[0]):
            out = CTC[func](*args)
            if func is torch.ops.aten._ctc_loss_backward.Tensor:  # its backward variables, log_alpha's size
                self._transient(args[6].untyped_storage().nbytes())
        else:
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
        self._transient(0)

    def _transient(self, size: int) -> None:
        """Raise the peaks to the live bytes and ``size`` more, which an operator allocates and
        frees inside itself at this moment (0: the live bytes alone)."""
        now = self.live_bytes + size
        self.peak_bytes = max(self.peak_bytes, now)
        if self.in_block > 0:
            self.in_block_peak_bytes = max(self.in_block_peak_bytes, now)
            if self.in_forward:
                self.in_block_forward_peak_bytes = max(self.in_block_forward_peak_bytes, now)
        if self.in_backward:
            self.in_backward_peak_bytes = max(self.in_backward_peak_bytes, now)
            if self.in_block > 0 and self.block_backward_done:
                self.in_block_backward_peak_bytes = max(self.in_block_backward_peak_bytes, now)
        if not self.in_forward:  # the loss's backward on (a block's before any gradient: a LoRA model's)
            if not self.block_backward_done:  # before any block's backward, or in the first block's
                window = 1 if self.in_block > 0 else 0
            else:  # in a later block's, or between and after the blocks'
                window = 2 if self.in_block > 0 else 3
            made, outside = self.made_peaks, now + 4 * self.made_outside_elements
            made[window] = max(made[window], now + 4 * self.made_elements)
            made[4 + window] = max(made[4 + window], outside)
            made[8 + window] = max(made[8 + window], outside + 4 * self.made_running_elements)
        kept, views = now + self.kept_bytes, self.view_peaks
        views[0] = max(views[0], kept)
        if self.in_forward:
            views[4] = max(views[4], kept + self.pending_bytes)
        if self.in_block > 0:
            views[1] = max(views[1], kept)
            if self.in_forward:
                views[3] = max(views[3], kept + self.pending_bytes)
        if self.in_backward:
            views[2] = max(views[2], kept)

    def to_state(self, key: int) -> None:
        """Storage ``key`` is model state from now on (a gradient accumulated into ``.grad``):
        not counted here, also when a later operator returns a view of it."""
        self._state.add(key)
        self.release(key)

    def to_gradient(self, key: int) -> None:
        """Storage ``key`` is a parameter's gradient (model state, :meth:`to_state`); the first one
        starts ``in_backward``."""
        self.to_state(key)
        if not self.in_backward:
            self.in_backward = True
            self.in_backward_peak_bytes = self.live_bytes
            self.view_peaks[2] = self.live_bytes + self.kept_bytes

    def arrive(self, param: torch.Tensor, outside: bool) -> None:
        """The first gradient of ``param`` arrived: its elements are made (counted once, whatever
        number of gradients a tied parameter receives); ``outside``: a parameter outside the
        repeated blocks."""
        if id(param) not in self._arrived:
            self._arrived.add(id(param))
            self.made_elements += param.numel()
            self.made_outside_elements += param.numel() if outside else 0
            self.made_running_elements += 0 if outside else param.numel()
            self._transient(0)

    def block_ended(self) -> None:
        """A block's backward ended (the gradient of its input arrived): its made elements are no
        longer the running block's; the moment's live bytes with every made element and with
        those outside the blocks and in that block raise ``made_peaks``' last two."""
        made, now = self.made_peaks, self.live_bytes
        made[12] = max(made[12], now + 4 * self.made_elements)
        made[13] = max(made[13], now + 4 * (self.made_outside_elements + self.made_running_elements))
        self.made_running_elements = 0

    def keep(self, key: int, size: int) -> None:
        """Autograd saved a view of the parameter whose storage is ``key`` (``size`` bytes): counted
        in ``kept_bytes`` until every such view is freed (:meth:`unkeep`), no longer pending."""
        entry = self._kept.setdefault(key, [0, size])
        entry[0] += 1
        if entry[0] == 1:
            self.kept_bytes += size
            self.pending_bytes -= self._pending.pop(key, 0)
            self._transient(0)

    def unkeep(self, key: int) -> None:
        """One saved view of the parameter whose storage is ``key`` was freed."""
        entry = self._kept[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.kept_bytes -= entry[1]
            del self._kept[key]

    def pend(self, sizes: dict[int, int]) -> None:
        """The parameters of ``sizes`` (storage key -> bytes) are held until their module's forward
        ends (:meth:`claim`)."""
        self._pending = dict(sizes)
        self.pending_bytes = sum(sizes.values())

    def claim(self, key: int) -> None:
        """The forward of the module of the parameter whose storage is ``key`` ended: no longer
        pending. Nothing once backward began (a recomputed forward)."""
        if self.in_forward:
            self.pending_bytes -= self._pending.pop(key, 0)

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


class _SavedView:
    """A saved view of a counted parameter, as autograd holds it (:func:`_kept_views`)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _linear_transpose(t: torch.Tensor, shapes: dict[int, tuple]) -> bool:
    """Whether ``t`` is the whole transpose of a 2-D parameter (``shapes``: storage key ->
    (shape, stride, offset)): what torch's linear saves of its weight (``addmm``'s ``mat2``)."""
    shape, stride, offset = shapes[t.untyped_storage()._cdata]
    return (len(shape) == 2 and tuple(t.shape) == shape[::-1] and tuple(t.stride()) == stride[::-1]
            and t.storage_offset() == offset)


@contextlib.contextmanager
def _kept_views(counter: _LiveBytes, model: nn.Module, params: list[nn.Parameter], kept_numel: Optional[int],
                linear_saves_weight: bool = True):
    """While inside, count in ``counter.kept_bytes`` each parameter of more than ``kept_numel``
    elements whose *view* autograd saves for backward (an expert's slice of a fused expert
    weight, a transposed weight a matrix product saves), from the save until autograd frees it,
    and in ``counter.pending_bytes`` each such parameter until its module's first forward ends; a
    parameter saved as itself is not counted. None: nothing counted.

    Why: DeepSpeed ZeRO-3 gathers a partitioned parameter into a new buffer for its module and
    releases it after the module's forward by pointing the parameter at an empty tensor
    (``free_param``: ``param.data = torch.empty(0)``); a view saved meanwhile still holds the
    gathered buffer, until backward uses it. Its coalesced prefetch copies every parameter out of
    the prefetch buffer when the first of them is claimed, so until a module's forward ends its
    parameters' copies are held (:func:`memtrain.memory.zero_accounting.zero_state_bytes`). With
    ``linear_saves_weight`` (DeepSpeed's ``memory_efficient_linear``, its default, which its
    ZeRO-3 engine puts in place of torch's linear for the run: ``zero3_linear_wrap`` saves the
    weight itself) a linear layer's saved ``weight.t()`` is not counted. Parameters at or under
    the persistence threshold are whole anyway. Inside an activation-checkpointed block torch's
    own hooks decide what is saved, so nothing there is counted (a recomputed block's parameters
    are gathered then)."""
    if kept_numel is None:
        yield
        return
    large = [p for p in params if p.numel() > kept_numel]
    sizes = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in large}
    shapes = {p.untyped_storage()._cdata: (tuple(p.shape), tuple(p.stride()), p.storage_offset()) for p in large}

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in sizes or isinstance(t, nn.Parameter) or (linear_saves_weight and _linear_transpose(t, shapes)):
            return t
        saved = _SavedView(t)
        counter.keep(key, sizes[key])
        weakref.finalize(saved, counter.unkeep, key)
        return saved

    def unpack(saved):
        return saved.tensor if isinstance(saved, _SavedView) else saved

    def claim(module, *_):
        for p in module.parameters(recurse=False):
            counter.claim(p.untyped_storage()._cdata)

    owners = [m for m in model.modules() if any(p.numel() > kept_numel for p in m.parameters(recurse=False))]
    hooks = [m.register_forward_hook(claim) for m in owners]
    counter.pend(sizes)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        for hook in hooks:
            hook.remove()


def _first_grad_tensor(values) -> Optional[torch.Tensor]:
    """The first floating-point tensor in ``values`` (nested) that requires grad, or None."""
    return next((t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)


def _watch_blocks(counter: _LiveBytes, blocks: list[nn.Module]) -> list:
    """Hooks that keep ``counter.in_block`` the number of ``blocks`` running: +1 from a block's
    forward pre-hook to its forward hook; in backward, +1 when the gradient of the block's output
    arrives (its backward starts) and −1 when the gradient of its input does (a tensor hook on each,
    so the graph is not changed). A recomputed forward under activation checkpointing counts as a
    forward; its tensors never receive gradients, so their hooks never fire. Returns the handles."""
    def enter(*_):
        counter.in_block += 1

    def leave(*_):
        counter.in_block -= 1
        counter.block_backward_done = counter.block_backward_done or counter.in_backward

    def backward_ended(*_):
        counter.block_ended()
        leave()

    def pre(module, args, kwargs):
        enter()
        first = _first_grad_tensor((args, kwargs))
        if first is not None:
            first.register_hook(backward_ended)

    def post(module, args, kwargs, output):
        leave()
        first = _first_grad_tensor(output)
        if first is not None:
            first.register_hook(enter)

    return [h for b in blocks for h in (b.register_forward_pre_hook(pre, with_kwargs=True),
                                        b.register_forward_hook(post, with_kwargs=True))]


class StepPeaks(NamedTuple):
    """Peak bytes of a micro-step beyond model state (:func:`step_peaks`), at three moments, and
    what is held at all of them.

    Attributes:
        peak: at most.
        in_block: at most while one of the model's repeated blocks
            (:func:`memtrain.models.repeated_blocks`) runs its forward or backward: what an engine
            that gathers a block's parameters only then (FSDP2, ZeRO-3) holds beside them; outside
            the blocks (embeddings, the head, the loss and its gradient with respect to the logits)
            nothing of theirs is gathered. The peak for a model without repeated blocks (whatever
            an engine gathers may be held at any moment).
        in_backward: at most from the moment the first parameter gradient arrives: what an engine
            that allocates a gradient buffer then (ZeRO-2's reduce bucket) holds beside it.
        resident: held through the whole optimizer step beside the model state, at every moment:
            the rank's batch on the device (the loop moves it there whole and cuts its
            micro-batches as views) and the data fingerprint's column weights
            (:func:`memtrain.fingerprint.weight_bytes`), not part of the three above.
        kept: (peak, in_block, in_backward) with the parameters autograd keeps through a saved
            view counted too (:func:`_kept_views`: what DeepSpeed ZeRO-3's gathered parameters
            hold beyond their release), and in_block_forward with those and the parameters whose
            module has not yet run its forward (ZeRO-3's copies out of its coalesced prefetch);
            () when not traced.
        in_block_backward: at most while a repeated block runs its backward after another
            block's backward ended: what an engine holds beside a block's gathered parameters only
            then (FSDP2's reduce-scatter of the block before) is held beside it; None = ``in_block``.
        in_block_forward: at most while a repeated block runs its forward (before the loss's
            backward; a block recomputed in backward is not counted): what an engine
            holds beside a block's gathered parameters only in forward (ZeRO-3's coalesced
            prefetch buffer) is held beside it; None = ``in_block``.
        made: from the loss's backward on, the live bytes plus 4 bytes per element of
            the parameters whose gradient has arrived, at most, in four windows of backward:
            before any block's backward (the loss's and the head's), in the first block's, in a
            later block's, and between and after the blocks' (the embeddings'); a window with no
            moment 0; then the four with the elements outside the repeated blocks alone; then the
            four with those outside and the running block's (an engine holding the blocks'
            gradients as shards, the running block's whole, counts between the first four and
            these); then, at the moments a block's backward ends (an engine's reduce of that
            block's gradients), the live bytes with every made element and with those outside and
            in that block (:data:`MADE_PEAKS` in all). A plan that does not
            accumulate holds only the gradients made so far, at most 4 bytes per element
            (:func:`memtrain.memory.peak.peak_tensor_bytes`). With alike blocks each window grows
            linearly with depth (at a later block the live bytes fall by a block's activations,
            the made ones rise by a block's gradients: the most is at the second block or the
            last, whichever grows faster, at every depth; :mod:`memtrain.memory.depth`). Without
            repeated blocks each window is the whole backward's. () = not traced.
    On a small model the peak is often the loss's (the tests' models at micro-batch 4: the
    logits of a 1024-token vocabulary), where neither is held.
    """

    peak: int
    in_block: int
    in_backward: int
    resident: int = 0
    kept: tuple = ()
    in_block_backward: Optional[int] = None
    in_block_forward: Optional[int] = None
    made: tuple = ()


def step_peaks(model: nn.Module, mode, objective, micro_batch: dict[str, torch.Tensor],
               kept_numel: Optional[int] = None, linear_saves_weight: bool = True) -> StepPeaks:
    """Peak bytes of one training forward and backward of ``micro_batch`` beyond model state
    (:class:`StepPeaks`: at most, while a block runs, from the first parameter gradient on; and
    with ``kept_numel``, the same with parameters of more elements than that kept through a saved
    view, ``StepPeaks.kept``: :func:`_kept_views`).

    Args:
        model: a fake model (:func:`fake_model`, levers applied).
        kept_numel: ZeRO-3's persistence threshold (elements); None = no kept peaks.
        linear_saves_weight: a linear layer saves its weight itself (DeepSpeed's
            ``memory_efficient_linear``), not a view of it.
        mode: its ``FakeTensorMode``.
        objective: the run's objective (:mod:`memtrain.objectives`); its ``loss_sum`` is traced.
        micro_batch: tensors [B, …] on any device (made fakes on the model's device here).

    Returns:
        :class:`StepPeaks` (bytes of saved activations and transients).
    """
    counter = _LiveBytes()
    for t in [*model.parameters(), *model.buffers()]:  # model state; views of it (a transposed weight) too
        counter.to_state(t.untyped_storage()._cdata)
    params = [p for p in model.parameters() if p.requires_grad]
    # the gradient autograd hands over, and the copy AccumulateGrad makes of it when its layout
    # differs from the parameter's (a transposed Linear weight's): both are the gradient
    blocks = repeated_blocks(model)
    inside = {id(p) for block in blocks for p in block.parameters()}

    def arrived(p: nn.Parameter):
        def hook(grad: torch.Tensor) -> None:
            counter.to_gradient(grad.untyped_storage()._cdata)
            counter.arrive(p, id(p) not in inside)
        return hook

    hooks = [p.register_hook(arrived(p)) for p in params]
    hooks += [p.register_post_accumulate_grad_hook(lambda p: counter.to_gradient(p.grad.untyped_storage()._cdata))
              for p in params]
    hooks += _watch_blocks(counter, blocks)
    device = next(model.parameters()).device
    try:
        with mode, fused_attention(device.type == "meta"):
            batch = fake_batch(mode, micro_batch, device)
            with torch.enable_grad(), counter, _kept_views(counter, model, params, kept_numel, linear_saves_weight):
                loss = objective.loss_sum(model, batch)
                counter.in_forward = False
                loss.backward()
                del loss
    finally:
        for hook in hooks:
            hook.remove()
        for p in params:
            p.grad = None
    in_block = counter.in_block_peak_bytes if blocks else counter.peak_bytes
    views, made = counter.view_peaks, counter.made_peaks
    kept = () if kept_numel is None else (views[0], views[1] if blocks else views[0], views[2],
                                          views[3] if blocks else views[4])
    return StepPeaks(counter.peak_bytes, in_block, counter.in_backward_peak_bytes, kept=kept,
                     in_block_backward=counter.in_block_backward_peak_bytes if blocks else counter.in_backward_peak_bytes,
                     in_block_forward=counter.in_block_forward_peak_bytes if blocks else counter.peak_bytes,
                     made=tuple(made) if blocks else (made[0],) * 4 + (made[4],) * 8 + (0, 0))


def step_peak_bytes(model: nn.Module, mode, objective, micro_batch: dict[str, torch.Tensor]) -> int:
    """:func:`step_peaks`' ``peak``: the micro-step's peak bytes beyond model state."""
    return step_peaks(model, mode, objective, micro_batch).peak


def fake_model(build: Callable[[], nn.Module], dtype: Optional[torch.dtype] = None,
               device: Optional[torch.device] = None):
    """A model with fake parameters (no memory): built on the meta device, then every parameter and
    buffer turned into a fake tensor on ``device`` so data-dependent checks in model code see a
    tracer and operators pick the kernels they pick on that device.

    The device matters: ``scaled_dot_product_attention`` on CPU and CUDA runs a fused kernel that
    saves its output and a log-sum-exp, while on the meta device it would fall back to the math
    path, which saves the ``[B, heads, T, T]`` attention weights of every layer (the tiny recipe's
    model at micro-batch 16: 4.2 MB, 10%, more than a real CPU run holds); a meta trace therefore
    stands the fused kernel in (:func:`memtrain.memory.fake_ops.fused_attention`).

    Args:
        build: builds the model (called under ``torch.device("meta")``).
        dtype: cast floating-point parameters to this dtype (a bf16/fp16 run's compute dtype).
        device: the device the fakes claim (None: meta).

    Returns:
        (the model in train mode, the ``FakeTensorMode`` to trace it under).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"):
        model = build()
    config = getattr(model, "config", None)
    if getattr(config, "apply_spec_augment", False):  # a speech model's SpecAugment draws its masks in NumPy
        plain = copy.copy(config)  # from the lengths, unknown here; they hold one bool per frame
        plain.apply_spec_augment = False  # (a copy: a user's function may share its config)
        for module in model.modules():  # the inner model (WavLMForCTC.wavlm) reads its own reference
            if getattr(module, "config", None) is config:
                module.config = plain
    made: dict[int, torch.Tensor] = {}  # by the meta tensor's id: tied parameters stay one parameter

    def fake(t: torch.Tensor) -> torch.Tensor:
        t = t.to("meta")  # a tensor a model makes on the CPU inside its constructor (WavLM's) as well
        t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        return (mode.fake_tensor_converter.from_meta_and_device(mode, t, device) if device is not None
                else mode.from_tensor(t))

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(fake(p.detach()), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                if id(b) not in made:
                    made[id(b)] = fake(b)
                module._buffers[name] = made[id(b)]
    return model.train(), mode


def trace_device(device_type: str) -> torch.device:
    """The device a planner's fake tensors claim: the run's own when this machine has it (its
    kernels are the run's), else meta (a GPU planned from a machine without one: attention as a
    fused kernel holds it, :func:`memtrain.memory.fake_ops.fused_attention`; other operators as their meta functions say)."""
    if device_type == "cpu" or (device_type == "cuda" and torch.cuda.is_available()):
        return torch.device(device_type)
    return torch.device("meta")


COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``model``'s forward as Accelerate's ``prepare`` does under mixed precision: inside
    ``torch.autocast(device_type, dtype)``, floating-point outputs converted to fp32
    (``accelerate.utils.convert_outputs_to_fp32``), so a trace holds what the run holds."""
    import types

    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward
    if hasattr(forward, "__func__"):  # a bound method (a user's instance-level function is wrapped as is)
        forward = torch.autocast(device_type, dtype)(forward.__func__)
        model.forward = types.MethodType(convert_outputs_to_fp32(forward), model)
    else:
        model.forward = convert_outputs_to_fp32(torch.autocast(device_type, dtype)(forward))


def compute_precision_model(model_build, precision: str, device_type: str, autocast: bool):
    """``(model, mode, extra_bytes)``: the fake model as the engine computes with it — under
    Accelerate's autocast (``autocast``, the engine's ``AUTOCAST_MIXED_PRECISION``: fp32 parameters
    and a forward in the compute dtype, each matrix cast on use, the copy saved for backward, and
    norms, softmax and the outputs in fp32), else with parameters held in the compute dtype — and
    bytes to add to each trace where autocast cannot be traced (a GPU planned from a machine without one traces on meta: fp32 activations, about twice the
    compute dtype's, plus each matrix's cast copy counted here)."""
    dtype = COMPUTE_DTYPES.get(precision)
    device = trace_device(device_type)
    autocast = autocast and dtype is not None  # fp32: no autocast, whatever the engine
    model, mode = fake_model(model_build, None if autocast else dtype, device)
    if not autocast:
        return model, mode, 0
    if device.type != "meta":
        autocast_forward(model, device.type, dtype)
        return model, mode, 0
    itemsize = torch.finfo(dtype).bits // 8
    return model, mode, itemsize * sum(p.numel() for p in model.parameters() if p.dim() >= 2)
