"""Bytes of model state, written once: per engine, offload and precision (parameters, gradients,
AdamW's state), per rank; DeepSpeed ZeRO's, by stage, in :mod:`memtrain.memory.zero_accounting`.
The engines report what they hold through these modules (``Backend.model_state_bytes``), and the
planner, the placement planner and ``memtrain plan`` use the same functions.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from memtrain.memory.moments import ddp_moments, fsdp_moments, parameter_element_bytes, with_optimizer_bytes
from memtrain.memory.shape import ModelShape

ADAM_STATE_BYTES = 8
"""exp_avg + exp_avg_sq in fp32, per parameter (AdamW's state; ZeRO paper, Rajbhandari et al. 2020, §3.1)."""


CUDA_HEADROOM_FRACTION = 0.10
"""CUDA: predicted peak × (1 + this) for the caching allocator's fragmentation and temporaries."""
CUDA_RESERVED_BYTES = 512 * 2**20
"""CUDA: bytes kept free for the CUDA context's workspaces (cuBLAS, NCCL)."""


def with_allocator_headroom(device_bytes: int, device_type: str) -> int:
    """Bytes a rank needs on its device for ``device_bytes`` of tensors: on CUDA
    :data:`CUDA_HEADROOM_FRACTION` more plus :data:`CUDA_RESERVED_BYTES`; elsewhere (the CPU, the
    simulated device, which counts tensors exactly) the same."""
    if device_type == "cuda":
        return int(device_bytes * (1 + CUDA_HEADROOM_FRACTION)) + CUDA_RESERVED_BYTES
    return device_bytes


def without_allocator_headroom(planned_bytes: int, device_type: str) -> int:
    """The tensor bytes of a planned peak: :func:`with_allocator_headroom` undone (bytes)."""
    if device_type == "cuda":
        return int((planned_bytes - CUDA_RESERVED_BYTES) / (1 + CUDA_HEADROOM_FRACTION))
    return planned_bytes


DEVICE_STATE_KEYS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "buffer_bytes")
"""The keys of a ``model_state_bytes`` dict that are bytes on the device."""


INT8_BLOCK = 256
"""Elements per fp32 scale of torchao's 8-bit AdamW states."""
INT8_MIN_ELEMENTS = 4096
"""torchao's 8-bit AdamW keeps tensors of fewer elements (or not a multiple of the block) in fp32."""


def adam_state_bytes(state_dtype: str, numels: Iterable[int]) -> int:
    """Bytes of AdamW's two moments for parameters of ``numels`` elements each, kept in
    ``state_dtype`` (``optimizer.state_dtype``): fp32 8 bytes per element, bf16 4, int8 2 plus
    two fp32 scales per :data:`INT8_BLOCK` elements and two 256-entry fp32 code maps per tensor
    (torchao's layout, counted from its tensors; small tensors in fp32).

    Raises:
        ValueError: an unknown dtype.
    """
    numels = list(numels)
    if state_dtype == "fp32":
        return ADAM_STATE_BYTES * sum(numels)
    if state_dtype == "bf16":
        return ADAM_STATE_BYTES // 2 * sum(numels)
    if state_dtype == "int8":
        return sum(2 * n + 8 * (n // INT8_BLOCK) + 2 * 1024 if n >= INT8_MIN_ELEMENTS and n % INT8_BLOCK == 0
                   else ADAM_STATE_BYTES * n for n in numels)
    raise ValueError(f"optimizer.state_dtype: '{state_dtype}' is not one of fp32, bf16, int8")


def replicated_optimizer_bytes(state_dtype: str, shape: ModelShape) -> int:
    """Per-rank bytes of AdamW's moments where every rank holds them all (DDP)."""
    return adam_state_bytes(state_dtype, shape.trained_numels)


def sharded_optimizer_bytes(state_dtype: str, shape: ModelShape, world_size: int) -> int:
    """Per-rank bytes of AdamW's moments where each rank holds its shard (FSDP2): torchao decides
    per shard whether it quantizes, so int8 is counted on shards of ``ceil(numel / world_size)``
    elements, each with its own code maps."""
    numels = shape.trained_numels
    w = max(1, world_size)
    if state_dtype == "int8":
        return adam_state_bytes(state_dtype, [-(-n // w) for n in numels])
    return adam_state_bytes(state_dtype, numels) // w


def with_optimizer_element_bytes(state: dict[str, int], element_bytes: Optional[float]) -> dict[str, int]:
    """``state`` (a ``model_state_bytes`` dict counting AdamW's fp32 moments, on the device) with
    ``optimizer_bytes`` for an optimizer keeping ``element_bytes`` per parameter element instead
    (a Python caller's: :func:`memtrain.optim.state_bytes_per_element`); None = ``state``."""
    if element_bytes is None:
        return state
    return with_optimizer_bytes(state, round(state["optimizer_bytes"] * element_bytes / ADAM_STATE_BYTES))


def fsdp_state_bytes(n_params: int, precision: str, offload: str, world_size: int, shape: ModelShape,
                     state_dtype: str = "fp32", offload_optimizer_ratio: float = 1.0) -> dict[str, int]:
    """Per-rank bytes of FSDP2's model state (:func:`_fsdp`; offload ``optimizer``:
    :func:`_fsdp_optimizer_offload`); the keys of :func:`memtrain.backends.model_state_bytes`."""
    w = max(1, world_size)
    optim = sharded_optimizer_bytes(state_dtype, shape, w)
    state = (_fsdp_optimizer_offload(n_params, precision, w, shape, optim, offload_optimizer_ratio)
             if offload == "optimizer" else _fsdp(n_params, precision, offload, w, shape, optim))
    return {"nvme_offloaded_bytes": 0, "step_gradient_bytes": 0, "accumulation_host_bytes": 0, **state,
            **fsdp_moments(state, shape, precision, w, offload)}


def ddp_state_bytes(n_params: int, world_size: int, shape: ModelShape, state_dtype: str = "fp32",
                    deferred_reduction: bool = True) -> dict[str, int]:
    """Per-rank bytes of DDP's model state (:func:`_ddp`; ``deferred_reduction``: the all-reduce
    after backward, as with ``memory.oom_recovery`` on); the keys of
    :func:`memtrain.backends.model_state_bytes`."""
    state = _ddp(n_params - shape.frozen, max(1, world_size), replicated_optimizer_bytes(state_dtype, shape),
                 max(shape.trained_numels, default=shape.largest_module) if deferred_reduction else None,
                 shape.frozen_bytes)
    return {"nvme_offloaded_bytes": 0, "accumulation_gradient_bytes": 0, "accumulation_host_bytes": 0, **state,
            **ddp_moments(state, shape)}


def device_state_bytes(state_bytes: dict[str, int]) -> int:
    """Model-state bytes on the device, from a ``model_state_bytes`` dict (offloaded bytes excluded)."""
    return sum(state_bytes.get(k, 0) for k in DEVICE_STATE_KEYS)


def build_bytes(shape: ModelShape) -> int:
    """Bytes of a model while it is built whole (:func:`memtrain.models.build_model`): every
    parameter in fp32 (4 bytes), plus one largest module's parameters again (4 bytes each: an
    engine casts or copies the built parameters one at a time, the old copy freed after)."""
    return 4 * (shape.parameters + shape.largest_module)


def builds_on_device(shape: ModelShape, state: dict[str, int], device_type: str) -> bool:
    """Whether a fresh model is built directly on the device (never whole on the host): on CUDA,
    when the whole model in fp32 (:func:`build_bytes`) is no more than the model state the engine
    keeps on each device (``state``: a ``model_state_bytes`` dict), so the build's moment never
    raises the device's peak. Else it is built in host memory, one whole copy a rank, and moved.

    Where it comes from: torchtitan builds on the meta device and initializes the shards on the
    GPU; DeepSpeed's ``zero.Init`` partitions each module as it is built. This is the case without
    either: the engine keeps at least a whole fp32 model's bytes on the device anyway (one rank,
    or an offload keeping 16-bit parameters and gradients there)."""
    return device_type == "cuda" and build_bytes(shape) <= device_state_bytes(state)


DEFERRED_REDUCE_BUCKET_BYTES = 64 * 2**20
"""DDP with OOM recovery: the gradients are all-reduced after backward in flat buckets of about
this many bytes (``memtrain.backends.ddp``), one bucket alive at a time."""


def _ddp(n_params: int, world_size: int, optim: int, largest_parameter: Optional[int],
         frozen_bytes: int = 0) -> dict[str, int]:
    """Every rank holds everything: Accelerate's autocast keeps fp32 parameters and gradients
    (cast for compute) and AdamW's two moments (``optim`` bytes). With OOM recovery on
    (``largest_parameter`` given) the model is not wrapped in DDP: the all-reduce after backward
    holds one flat bucket of :data:`DEFERRED_REDUCE_BUCKET_BYTES` plus at most one parameter's
    gradient, with the activations freed (``step_gradient_bytes``; MemTracker, GPT-2 small's
    blocks, fp32, 2 ranks, AC on: 141.5 MB above the state while two buckets were alive at once).
    With recovery off (``largest_parameter`` None) on more than one rank, DDP's reducer overlaps
    backward and allocates its buckets, a second copy of the fp32 gradients (``buffer_bytes``;
    MemTracker: 1.08 MB for a 0.27M-parameter model on 2 ranks). ``n_params`` counts the
    parameters that train; the frozen ones (a LoRA model's base) are ``frozen_bytes`` of
    parameters in their own dtype, with no gradient or optimizer state. The gradients are set to
    None after each step (``fresh_gradient_bytes``: :func:`memtrain.memory.peak.plan_terms`), so a
    moment of backward holds those made so far, 4 bytes per element (``made_gradient_slack_bytes``
    none beyond)."""
    n = n_params
    deferred = world_size > 1 and largest_parameter is not None
    reducer = world_size > 1 and largest_parameter is None
    bucket = min(4 * n, DEFERRED_REDUCE_BUCKET_BYTES + 4 * largest_parameter) if deferred else 0
    return {"parameter_bytes": 4 * n + frozen_bytes, "gradient_bytes": 4 * n, "optimizer_bytes": optim,
            "buffer_bytes": 4 * n if reducer else 0, "cpu_offloaded_bytes": 0, "step_gradient_bytes": bucket,
            "fresh_gradient_bytes": 4 * n, "made_gradient_slack_bytes": 0}


def _fsdp(n_params: int, precision: str, offload: str, world_size: int, shape: ModelShape,
          optim: int) -> dict[str, int]:
    """fp32 parameters and gradients and AdamW's moments (``optim`` bytes per rank), sharded over
    ranks (FSDP2's mixed-precision policy casts for compute); CPUOffloadPolicy moves all three to host memory. On the device
    beside them, in the compute dtype: the root unit's parameters (embeddings, head, final norm),
    gathered from its forward to the end of backward (memtrain does not reshard the root), and
    their unsharded gradients through the backward; a block's parameters gathered, two on more
    than one rank (the one running and the one prefetched), only while a block runs
    (:func:`_fsdp_block_terms`; ``block_buffer_bytes``, part of ``buffer_bytes``:
    :func:`memtrain.memory.peak.peak_tensor_bytes`; MemTracker on 2 ranks finds none gathered at the peak of Llama,
    Mistral, Qwen2, GPT-NeoX and GPT-2 models of 0.6–2M parameters, which is the loss's:
    ``benchmarks/memory_accuracy.py --families``). A block's gradients are reduce-scattered in
    fp32 (``reduce_dtype``) after its backward (on one rank copied from the same input into the
    same output buffer: torch's ``foreach_reduce``), the input held until the next block's
    reduce-scatter: 4 bytes per parameter of a block beside the gathered ones while a later block
    runs its backward (``block_backward_buffer_bytes``; MemTracker at the peak of a bf16 Mistral
    with AC on, 2 ranks: that buffer, one block gathered, 6.0% under without it; of an fp32 Qwen2
    with AC on, 1 rank: 2.1 MB of it, one block's). While micro-batches accumulate,
    every unsharded gradient is kept in fp32 (``set_requires_gradient_sync(False)``) until the last micro-batch
    reduces it: 4 bytes per parameter in all, the root's among them (``accumulation_gradient_bytes``
    is what they hold beyond ``gradient_bytes``: less than none on one rank, where that counts the
    root's twice; MemTracker, fp32, 1 rank: 4 bytes per parameter of gradients at the peak). There the reduce-scatter input is copied from a
    block's accumulated gradients, which are then freed, so a later block's backward holds beside
    them only that block's output shard (4 bytes per parameter of a block over the ranks) and,
    under a 16-bit compute dtype, the running block's new gradients before they are added to the
    fp32 ones (``u`` bytes per parameter of a block; in fp32 they are added in place), as the root's
    are from the head's gradient on to the end of backward (``u`` bytes per root parameter beside
    the fp32 ones in ``accumulation_gradient_bytes``):
    ``accumulated_block_backward_buffer_bytes`` (torch's ``FSDPParamGroup.post_backward``;
    MemTracker, fp32, 2 ranks, accumulating: Mixtral 4.5% and Qwen2 6.6% over with the input
    counted beside them). The root's new 16-bit gradients are not there before backward
    (``accumulated_fresh_gradient_bytes``). A plan that does not accumulate sets the gradients to
    None after each step (``fresh_gradient_bytes``: :func:`memtrain.memory.peak.plan_terms`; MemTracker, 2 ranks, one
    micro-batch per step: GPT-NeoX 18–26% and Mixtral 7–8% over with them counted at the loss),
    so a moment of its backward holds those made so far, at most 4 bytes per element, a
    block's as shards (``block_gradient_shards``), and beside them what
    :func:`_fsdp_block_terms` bounds (``made_gradient_slack_bytes``). MemTracker on 2 ranks: the tiny recipe's
    model holds 1.08 MB of gradients = 4 × its 0.27M parameters; GPT-2 small's blocks (86M) hold
    one block gathered beside the root at the peak, and 2–2.5 blocks' bytes of gathered and
    reduce-scatter buffers. Frozen parameters (``shape.frozen``: a LoRA model's base) are
    sharded in their own dtype (``shape.frozen_bytes``) and have no gradient or optimizer state;
    the root's gradients are counted for at most the parameters that train."""
    w, n = world_size, n_params - shape.frozen
    u = parameter_element_bytes(precision)
    params, grads = (4 * n + shape.frozen_bytes) // w, 4 * n // w
    offloaded = {"parameter": 0, "gradient": 0, "optimizer": 0, "buffer": 0}  # CPUOffloadPolicy: all three
    if offload not in (None, "none"):
        offloaded.update(parameter=params, gradient=grads, optimizer=optim)
        params, grads, optim = 0, 0, 0
    shards = grads
    blocks = _fsdp_block_terms(u, shape, w, n)
    alone = 4 * shape.largest_block - blocks["block_backward_buffer_bytes"]
    params, grads = params + u * shape.root, grads + u * min(shape.root, n)
    # accumulating: every gradient in fp32, and in 16 bits the root's new ones beside them
    accumulated = 4 * n - (shards if u < 4 else grads)
    return {"parameter_bytes": params, "gradient_bytes": grads, "optimizer_bytes": optim, **blocks,
            "accumulated_block_backward_buffer_bytes": 4 * shape.largest_block // w + (
                u * shape.largest_block if u < 4 else 0) - alone, "fresh_gradient_bytes": grads,
            "accumulated_fresh_gradient_bytes": u * min(shape.root, n) if u < 4 else 0,
            "accumulation_gradient_bytes": accumulated, "cpu_offloaded_bytes": sum(offloaded.values()),
            **{f"offloaded_{k}_bytes": v for k, v in offloaded.items()}}


def offloaded_parameter_count(numels: Sequence[int], ratio: float) -> int:
    """How many of the last parameters (``numels``: each one's elements, in model order) FSDP2's
    optimizer offload keeps on the host for a share ``ratio`` of the elements: the fewest whose
    elements reach it (over by less than one parameter)."""
    total, held, count = sum(numels), 0, 0
    for n in reversed(numels):
        if held >= ratio * total - 0.5:
            break
        held, count = held + n, count + 1
    return count


def _fsdp_optimizer_offload(n_params: int, precision: str, world_size: int, shape: ModelShape, optim: int,
                            ratio: float) -> dict[str, int]:
    """FSDP2 with memtrain's optimizer offload (:class:`memtrain.backends.optimizer_offload.PartialOffloadAdamW`):
    parameters and gradients sharded in the compute dtype (``u`` bytes; 16-bit under bf16, so no
    fp32 copy on the device) with the root and two blocks gathered as in :func:`_fsdp`; AdamW's
    moments (``optim`` bytes per rank) and an fp32 master copy split by ``ratio`` — on the device
    ``1 - ratio`` of the moments and, for 16-bit parameters, of the master; on the host ``ratio``
    of the moments, of the master and a buffer of the host part's gradients in the compute dtype
    (the updated parameters go back through it: one block, pinned on a GPU, ``pinned_block_bytes``;
    freed for the export: ``export_released_bytes``). Every micro-batch reduce-scatters into the
    sharded gradients (:attr:`memtrain.backends.fsdp.FSDPBackend.reduces_every_micro_batch`), so
    accumulating holds nothing beyond them: no accumulation term; they are set to None after each
    step (``fresh_gradient_bytes``, as in :func:`_fsdp`).
    The host part is whole parameters, the last of the model (:func:`offloaded_parameter_count` of ``shape.numels``; ``ratio`` itself without them).
    Reported by component: ``offloaded_*_bytes``."""
    n, w = n_params, world_size
    u = parameter_element_bytes(precision)
    shard = n // w
    last = offloaded_parameter_count(shape.numels, ratio)  # whole parameters: the share they hold
    share = sum(shape.numels[len(shape.numels) - last:]) / max(1, sum(shape.numels)) if shape.numels else ratio
    host_elements = int(shard * share)
    master_device = 4 * (shard - host_elements) if u == 2 else 0
    moments_host = int(optim * share)
    offloaded = {"parameter": 0, "gradient": 0, "optimizer": moments_host + 4 * host_elements,
                 "buffer": u * host_elements}
    params, grads = u * shard + u * shape.root, u * shard + u * shape.root
    return {"parameter_bytes": params, "gradient_bytes": grads, "optimizer_bytes": optim - moments_host + master_device,
            **_fsdp_block_terms(u, shape, w, n), "accumulation_gradient_bytes": 0, "fresh_gradient_bytes": grads,
            "cpu_offloaded_bytes": sum(offloaded.values()), "export_released_bytes": offloaded["buffer"], "pinned_block_bytes": offloaded["buffer"],
            **{f"offloaded_{k}_bytes": v for k, v in offloaded.items()}}


def _fsdp_block_terms(u: int, shape: ModelShape, world_size: int, trained: int) -> dict[str, int]:
    """FSDP2's terms for its blocks, with and without the optimizer offload, in bytes
    (``u`` bytes per element of the compute dtype; ``trained``: the parameters that train).

    - Gathered blocks in the compute dtype (``buffer_bytes``, ``block_buffer_bytes``): on more
      than one rank two, the one running and the one prefetched; on one rank one, nothing
      prefetched (torch's ``FSDPParamGroup.unshard`` returns before any all-gather there, and
      ``wait_for_unshard`` copies the shard into the running block's parameters; MemTracker,
      Qwen2 fp32, 1 rank: one block's parameters at the peak).
    - ``block_backward_buffer_bytes``: a block's reduce-scatter input (4 bytes per element of a
      block), held while a later block runs its backward, less one gathered block where there
      is nothing left to prefetch (a model of two blocks on more than one rank, its later block
      the last; MemTracker, Mistral with AC on, 2 ranks: one gathered at the second block's backward).
    - A plan that does not accumulate (:func:`memtrain.memory.peak.peak_tensor_bytes`): a
      block's made gradients held as shards (``block_gradient_shards``), the running block's
      whole, and beside them one block's reduce-scatter input while a block runs its backward
      (``made_gradient_slack_bytes``: torch's ``FSDPParamGroup.post_backward`` frees the block
      before's, ``reduce_scatter_max_input_buffers`` 1, before it allocates a block's, and the
      running block's gradients after copying them in), and after the blocks the last one's or
      the root's, reduced at the end of backward (``made_gradient_tail_slack_bytes``).
    """
    block = u * shape.largest_block
    gathered, alone = (block, 0) if world_size <= 1 else (2 * block, block if shape.blocks == 2 else 0)
    reduce_input = 4 * shape.largest_block
    return {"buffer_bytes": gathered, "block_buffer_bytes": gathered,
            "block_backward_buffer_bytes": reduce_input - alone, "made_gradient_slack_bytes": reduce_input,
            "made_gradient_tail_slack_bytes": max(reduce_input, 4 * min(shape.root, trained)),
            "block_gradient_shards": world_size}


def divisors(n: int) -> list[int]:
    """The micro-batch sizes that divide a rank's share of ``n`` samples, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]
