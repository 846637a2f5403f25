"""Bytes of model state, written once: per engine, ZeRO stage, offload and precision (parameters,
gradients, AdamW's state), per rank. The engines report what they hold through this module
(``Backend.model_state_bytes``), and the planner, the placement planner and ``memtrain plan`` use
the same functions.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from memtrain.memory.moments import (ddp_moments, fsdp_moments, parameter_element_bytes, with_optimizer_bytes,
                                     zero_moments)
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


DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements)."""
DEEPSPEED_PREFETCH_ELEMENTS = 50_000_000
"""DeepSpeed's default ``stage3_prefetch_bucket_size`` (elements)."""
DEEPSPEED_REUSE_ELEMENTS = 1_000_000_000
"""DeepSpeed's default ``stage3_max_reuse_distance`` (elements)."""
ZERO3_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default ``stage3_param_persistence_threshold`` (elements): ZeRO-3 keeps every
parameter of at most this many elements whole on every rank instead of partitioning it."""


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


def zero_reduce_bucket_elements(n_params: int) -> int:
    """The ``reduce_bucket_size`` memtrain writes into a DeepSpeed config that does not set one:
    DeepSpeed's default, but never more than the model's parameters. ZeRO allocates the whole
    bucket as one gradient buffer whatever the model's size (MemTracker counts 1.9 GiB per rank for
    a 2.6M-parameter model under the default); a bucket the size of the model reduces everything
    in one call, which is all a larger one would do."""
    return max(1, min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, n_params))


def deepspeed_buffer_settings(shape: ModelShape, trainable: int, zero_stage: Optional[int] = None) -> dict[str, int]:
    """The ``zero_optimization`` buffer sizes (elements) and flags (1 or 0) memtrain writes into a
    DeepSpeed config that does not set them, so that :func:`memtrain.backends.model_state_bytes`
    counts what DeepSpeed allocates: ``reduce_bucket_size`` = :func:`zero_reduce_bucket_elements`
    of the ``trainable`` parameters; under ZeRO-2 (``zero_stage`` None is 2) ``reduce_scatter`` 0,
    which all-reduces the bucket in place (``gradient_reduction_w_predivide``). DeepSpeed's default
    (``reduce_scatter`` on, ``use_multi_rank_bucket_allreduce``) all-reduces the same bucket's
    elements, but through a flattened copy of it (``allreduce_bucket``: the whole gradients'
    bytes more at the end of backward; :func:`_zero`), so the communication is the same and the
    peak lower: MemTracker, GPT-NeoX of 1.3M parameters, activation checkpointing on, fp32, 2 CPU
    ranks, 4,801,820 bytes against 5,145,752 (DeepSpeed 0.19.8). ZeRO-3's default stays: its
    ``reduce_scatter`` is a real reduce-scatter, half an all-reduce's communication.

    ZeRO-3's gather limits stay at DeepSpeed's defaults and are counted
    (:func:`zero3_gathered_elements`): ``stage3_prefetch_bucket_size`` 5e7 and
    ``stage3_max_reuse_distance`` 1e9 elements. Smaller ones were tried on GPT-2 small's blocks
    (86M, 2 CPU ranks, DeepSpeed 0.19.8) — a prefetch of one block; a reuse distance of one to four
    blocks — and each stopped the run when the order of parameter use changed (the first
    evaluation, or the export after training with activation checkpointing) with DeepSpeed's
    "Cannot partition a param in flight". A user's JSON may set them; they are counted as set.
    """
    in_place = {"reduce_scatter": 0} if zero_stage in (None, 2) else {}
    return {"reduce_bucket_size": zero_reduce_bucket_elements(trainable), **in_place}


def zero3_persistent_elements(numels: Iterable[int], threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> int:
    """Elements of the parameters (``numels``: each parameter's element count) that ZeRO-3 keeps
    whole on every rank (DeepSpeed's ``mark_persistent_parameters``)."""
    return sum(n for n in numels if n <= threshold)


def zero3_gathered_elements(shape: ModelShape, settings: Mapping[str, int]) -> int:
    """Parameters ZeRO-3 holds gathered on a rank at once, at most: the submodule being run
    (``shape.largest_module``), the next ones prefetched (``stage3_prefetch_bucket_size``) and
    those kept for reuse (``stage3_max_reuse_distance``; DeepSpeed's
    ``PartitionedParameterCoordinator``), never more than the partitioned (not persistent) ones."""
    persistent = zero3_persistent_elements(
        shape.numels, settings.get("stage3_param_persistence_threshold", ZERO3_PERSISTENCE_THRESHOLD))
    held = (shape.largest_module + settings.get("stage3_prefetch_bucket_size", DEEPSPEED_PREFETCH_ELEMENTS)
            + settings.get("stage3_max_reuse_distance", DEEPSPEED_REUSE_ELEMENTS))
    return max(0, min(shape.parameters - persistent, held))


def zero_state_bytes(n_params: int, precision: str, zero_stage: Optional[int], offload: str, world_size: int,
                     offload_optimizer_ratio: float, offload_device: str, shape: ModelShape,
                     zero_settings: Optional[Mapping[str, int]] = None) -> dict[str, int]:
    """Per-rank bytes of DeepSpeed ZeRO's model state (:func:`_zero`), its buffers as memtrain sizes
    them (:func:`deepspeed_buffer_settings`) where ``zero_settings`` (the user's JSON's
    ``zero_optimization`` sizes, elements) does not set them; the keys of
    :func:`memtrain.backends.model_state_bytes`.

    Where ZeRO-3 gathers (more than one rank, or parameters offloaded), two more terms from
    DeepSpeed's ``PartitionedParameterCoordinator`` and ``free_param``, which releases a gathered
    parameter by pointing it at an empty tensor: ``view_kept_bytes``, every parameter over the
    persistence threshold, the most that views autograd saved can keep gathered beyond their
    release (:func:`memtrain.memory.peak.peak_tensor_bytes`' ``kept``; which ones, and when, the trace counts:
    :class:`memtrain.memory.step_trace.StepPeaks`' ``kept``); and ``step_gathered_bytes``, the
    first module's parameters over the threshold (``ModelShape.first_module_numels``: the input
    embeddings), the last module backward runs and the first the next forward does, so within
    the reuse distance and held gathered through the optimizer step (MemTracker at the step of
    Mistral's and GPT-NeoX's 2-rank rows: the parameters' partitions, persistent ones and that one
    module gathered; no other block's parameters, also on GPT-2 small's 86M).

    In forward the gathered parameters are held twice over (:func:`memtrain.memory.peak.peak_tensor_bytes`' ZeRO-3
    forward moment): once a step's parameter trace is complete (from the second micro-batch on),
    fetching a module prefetches the parameters used next, up to ``stage3_prefetch_bucket_size``
    elements, in one ``all_gather_coalesced`` into one flat buffer; the first of them a module
    claims copies every one out of it (``AllGatherCoalescedHandle.wait``: a ``torch.cat`` of its
    ranks' parts), and the buffer is held until the last of them is claimed (the coordinator's
    in-flight registry keeps the handle per parameter) — for a small model until the head, the
    copies beside it until each module's forward releases its own (DeepSpeed 0.19.8). Found with
    MemTracker at the peak of Mixtral's 2-rank rows (7.9M parameters, fp32): a 30.2 MB buffer of
    every expert weight and the head beside the same weights' copies, inside the last layer's
    experts."""
    settings = {**deepspeed_buffer_settings(shape, n_params - shape.frozen, zero_stage), **(zero_settings or {})}
    threshold = settings.get("stage3_param_persistence_threshold", ZERO3_PERSISTENCE_THRESHOLD)
    persistent = zero3_persistent_elements(shape.numels, threshold)
    state = _zero(
        n_params - shape.frozen, precision, zero_stage, offload, max(1, world_size), offload_optimizer_ratio,
        offload_device, settings["reduce_bucket_size"], persistent, zero3_gathered_elements(shape, settings),
        max(shape.trainable if shape.trainable is not None else shape.numels, default=0), shape.frozen,
        bool(settings.get("reduce_scatter", 1)) or not settings.get("contiguous_gradients", 1))
    # every gathered parameter may be kept by a saved view (peak_tensor_bytes' kept); the first
    # module's stay gathered through the step (its next use is the next forward's first)
    gathers = state["gathered_parameter_bytes"] > 0
    p_bytes = parameter_element_bytes(precision)
    first = p_bytes * sum(n for n in shape.first_module_numels if n > threshold) if gathers else 0
    return {**state, "view_kept_bytes": p_bytes * (shape.parameters - persistent) if gathers else 0,
            "step_gathered_bytes": first,
            **zero_moments(state, shape, precision, zero_stage, max(1, world_size), offload)}


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


def _zero(n_params: int, precision: str, zero_stage: Optional[int], offload: str, world_size: int,
          offload_optimizer_ratio: float, offload_device: str, reduce_bucket_elements: int,
          persistent_elements: int, gathered_elements: int, largest_parameter: int = 0,
          frozen: int = 0, reduce_copy: bool = True) -> dict[str, int]:
    """ZeRO's accounting (Rajbhandari et al. 2020, §3.1 and §5), bytes per rank: 16-bit parameters
    and gradients in bf16/fp16 (fp32 otherwise) plus an fp32 master copy kept with AdamW's
    moments; stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters
    (default stage 2). ZeRO's optimizer keeps its fp32 master partition as a copy also when the
    model is fp32 (stages 1/2 clone it; stage 3 compares a ``torch.device`` with a device name,
    which never matches, so never aliases it); found by listing the optimizer's tensors after a
    step (fp32, 2 CPU ranks). Offload: :func:`_zero_offload`.

    DeepSpeed's own buffers: the reduce bucket, allocated whole in the parameters' dtype on the
    device (also under offload); ZeRO-3's small parameters (``persistent_elements``), kept whole
    on every rank's device beside their partition, never offloaded; ZeRO-3's gathered parameters
    (``gathered_elements``: :func:`zero3_gathered_elements`) in the parameters' dtype.

    From the end of the last backward to the step ZeRO-2 and ZeRO-3 hold the whole gradients'
    bytes once more beside their buckets and partitions (``step_gradient_bytes``; DeepSpeed copies
    each gradient into the reduce bucket and keeps a view, and MemTracker's step peak holds the
    same bytes again during the reduction): under ZeRO-2 the bucket's flattened copy, none where
    it is reduced in place (``reduce_copy`` false; :func:`_zero2_partition_terms`); under ZeRO-3
    also in place, beside its reduce copy (:func:`_zero3_reduce_copy`). ``step_whole_gradient_bytes``
    reports that transient apart (the tensor census of ``benchmarks/placement_accuracy.py`` finds
    the bucket). MemTracker on GPT-2
    small's blocks (86M, fp32, 2 ranks, the copy made) counts one peak with activation
    checkpointing off and on alike: ZeRO-2 20 bytes per parameter (parameters 4, copy 4, bucket 4,
    gradient partition 2, fp32 master partition 2, moments 4; on one rank equal to the byte's
    1e-5), ZeRO-3 the same with nothing gathered but the first module's parameters
    (:func:`zero_state_bytes`). With the optimizer on the host the whole gradients are held too:
    on 2 CPU ranks (a 25.8M GPT-2) the host bytes planned were 15% under the resident peak without
    them, 6-7% with them. With 16-bit parameters the optimizer step holds an fp32 copy of the
    rank's gradient partition (the larger of it and the copy counts): MemTracker on GPT-2 small's
    blocks in bf16 on one rank, 24 bytes per parameter under ZeRO-3 and 22 under ZeRO-2.
    ZeRO-3's gathered parameters are held while blocks run (``block_buffer_bytes``). On one rank
    ZeRO-3 gathers nothing: ``_no_gather_coalesced`` makes each parameter a view of its partition
    (a copy when the partition is on the host); MemTracker counts the parameters once.

    ``n_params`` counts the parameters that train; ``frozen`` more (a LoRA model's base) are held
    in the parameters' dtype, partitioned under ZeRO-3 and whole on every rank below it (ZeRO's
    optimizer flattens only the parameters it steps), with no gradient or optimizer state."""
    n, w = n_params, world_size
    stage = 2 if zero_stage is None else zero_stage
    p_bytes = parameter_element_bytes(precision)
    master = 4 if p_bytes == 2 or stage >= 1 else 0
    params = p_bytes * n // (w if stage >= 3 else 1) + p_bytes * frozen // (w if stage >= 3 else 1)
    grads = p_bytes * n // (w if stage >= 2 else 1)
    optim = (ADAM_STATE_BYTES + master) * n // (w if stage >= 1 else 1)
    off = _zero_offload(n, w, stage, p_bytes, offload, offload_optimizer_ratio, offload_device, largest_parameter,
                        params, grads, optim)
    params, grads, optim = off.pop("parameter_bytes"), off.pop("gradient_bytes"), off.pop("optimizer_bytes")
    buffers = p_bytes * reduce_bucket_elements + off.pop("staging_bytes")
    whole = p_bytes * n if stage >= 2 else 0  # under offload too (see above)
    on_device = offload in (None, "none")
    # ZeRO-2 reducing in place (memtrain's default, deepspeed_buffer_settings) makes no flattened copy
    step = 0 if stage == 2 and on_device and not reduce_copy else whole
    if p_bytes == 2 and on_device and stage >= 1:
        # 16-bit: at the step the whole gradients are gone and an fp32 copy of the partition is there
        # (stage 1, which keeps its 16-bit gradients whole as state, makes it the same way)
        step = max(step, 4 * n // w)
    transient, accumulating, backward, step_copy, step_accumulated = step, 0, 0, 0, 0
    if stage == 2 and on_device:
        partition, backward = _zero2_partition_terms(grads, p_bytes, largest_parameter, w, reduce_bucket_elements)
        # held from the first reduction to the step; at the step of a plan that accumulates, twice
        step, grads, accumulating, step_accumulated = step + 2 * partition, 0, partition, partition
    # on one rank a "gathered" parameter is a view of its partition (DeepSpeed's _no_gather_coalesced),
    # a copy only when the partition is on the host
    alone = w == 1 and offload != "optimizer_and_params"
    gathered = p_bytes * gathered_elements if stage >= 3 and not alone else 0
    if stage >= 3:  # whole persistent parameters beside their partitions (on one rank without
        # parameter offload their partitions are whole already); the gathered ones
        params += p_bytes * persistent_elements if w > 1 or offload == "optimizer_and_params" else 0
        buffers += gathered
        # a parameter larger than the bucket is reduced alone
        copy = _zero3_reduce_copy(p_bytes, n, reduce_bucket_elements, largest_parameter) if reduce_copy else 0
        if n <= reduce_bucket_elements:  # one bucket holds every gradient: reduced at the end of backward
            step, step_copy = step + copy, copy
        else:  # beside each reduce in backward (a buffer only then)
            buffers, backward = buffers + copy, copy
    return {"parameter_bytes": params, "gradient_bytes": grads, "optimizer_bytes": optim,
            "buffer_bytes": buffers, "step_gradient_bytes": step, "step_whole_gradient_bytes": transient,
            "step_reduce_copy_bytes": step_copy, "step_accumulated_partition_bytes": step_accumulated,
            "gathered_parameter_bytes": gathered, "block_buffer_bytes": gathered, "backward_buffer_bytes": backward,
            "accumulation_gradient_bytes": accumulating, **off}


def _zero_offload(n: int, w: int, stage: int, p_bytes: int, offload: str, ratio: float, offload_device: str,
                  largest_parameter: int, params: int, grads: int, optim: int) -> dict[str, int]:
    """What ZeRO-Offload (Ren et al. 2021) moves off the device, per rank: the device's
    ``parameter_bytes``, ``gradient_bytes``, ``optimizer_bytes`` left of ``params``, ``grads``,
    ``optim``; ``cpu_offloaded_bytes`` and ``nvme_offloaded_bytes``, the same by component
    (``offloaded_*_bytes``), and ``staging_bytes`` more on the device.

    The optimizer state leaves the device — ``ratio`` of it under ZeRO-3's partial offload — and
    the gradients are reduced into host buffers: fp32 partitions under stages 1/2 (stage 1 still
    holds its whole 16-bit gradients on the device until the accumulation boundary); under stage
    3 a 16-bit partition buffer plus the fp32 gradient DeepSpeed keeps beside every optimizer
    sub-group, on the device for the sub-groups stepped there. ``optimizer_and_params`` moves the
    parameters too. With ``offload_device`` ``nvme`` (stage 3) the offloaded optimizer state (with
    its fp32 gradients) and parameters are files. Stages 1/2 also stage through buffers DeepSpeed
    sizes by the model (found in its tensors after ``initialize``): on the host a 16-bit copy of
    the rank's parameter partition and a gradient buffer of the largest parameter
    (``largest_parameter`` elements), pinned on a GPU machine; on the device the same gradient
    buffer. While micro-batches accumulate, stages 1/2 keep each parameter of the partition whole
    in a 16-bit host buffer (``accumulated_grads_in_cpu``): ``accumulation_host_bytes``, counted
    for plans with gradient accumulation."""
    host = files = staging = accumulating = 0
    offloaded = {"parameter": 0, "gradient": 0, "optimizer": 0, "buffer": 0}  # host or NVMe, by component
    if offload in ("optimizer", "optimizer_and_params"):
        moved = offloaded["optimizer"] = int(optim * ratio)
        optim -= moved
        if stage >= 3:  # 16-bit partition buffer on the host; fp32 sub-group gradients where each steps
            host, grads, host_fp32 = p_bytes * n // w, int(4 * n / w * (1 - ratio)), int(4 * n / w * ratio)
            moved += host_fp32
            offloaded["gradient"] = host + host_fp32
        else:  # fp32 gradient partitions on the host; stage 1 keeps its full gradients until the boundary
            host, grads = 4 * n // w, grads if stage == 1 else 0
            offloaded["gradient"] = host
            offloaded["buffer"] = p_bytes * (n // w + largest_parameter)
            host, staging = host + offloaded["buffer"], p_bytes * largest_parameter
            # accumulating, each parameter of the partition is kept whole in a 16-bit host buffer
            accumulating = p_bytes * (n // w) + _edge_bytes(p_bytes, largest_parameter, w)
        if offload_device == "nvme":
            files += moved
        else:
            host += moved
    if offload == "optimizer_and_params":
        if offload_device == "nvme":
            files += params
        else:
            host += params
        offloaded["parameter"], params = params, 0
    return {"parameter_bytes": params, "gradient_bytes": grads, "optimizer_bytes": optim, "cpu_offloaded_bytes": host,
            "nvme_offloaded_bytes": files, "staging_bytes": staging, "accumulation_host_bytes": accumulating,
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


def _zero2_partition_terms(grads: int, p_bytes: int, largest_parameter: int, world_size: int,
                           reduce_bucket_elements: int) -> tuple[int, int]:
    """ZeRO-2's ``(gradient partition, reduce bucket)`` bytes on the device (:func:`_zero`).

    The partition buffer (``grads_in_partition``: ``grads`` plus the parameters across its edges
    whole, :func:`_edge_bytes`) lives from the first micro-batch's reduction to the step
    (``accumulation_gradient_bytes``; MemTracker before the last micro-batch's forward on 2 ranks:
    parameters, moments, master and gradient partitions, no bucket; Llama and GPT-NeoX of 0.6–1.4M
    parameters, fp32, equal to the byte's 1e-3). The last micro-batch's ``copy_grads_in_partition``
    allocates it anew after the bucket's reduction, and a plan that accumulates holds the earlier
    micro-batches' partition beside it (``all_grad_tensors``, views into the buffer they were
    copied into; ``step_accumulated_partition_bytes``). The bucket is allocated for backward only.

    DeepSpeed's default reduction (``reduce_scatter`` on) goes through a flattened copy of the
    bucket (``allreduce_bucket``), which on CPU lives until gloo's worker thread drops the
    collective's work, sometimes after the partition buffer is allocated (a 2-rank ``all_reduce``
    of 4 MB: its storage outlived the caller's last reference in 83 and 102 of 300 calls). MemTracker,
    Qwen2 with AC on, fp32, 2 ranks: one micro-batch per step, 28,911,256 bytes when the copy was
    still held (a third of the runs), 26,996,060 when not; two, 31,806,296 and 29,891,100.
    memtrain's default reduces in place (:func:`deepspeed_buffer_settings`): 26,996,060 and
    29,891,100 in every run."""
    return grads + _edge_bytes(p_bytes, largest_parameter, world_size), p_bytes * reduce_bucket_elements


def _zero3_reduce_copy(p_bytes: int, n: int, reduce_bucket_elements: int, largest_parameter: int) -> int:
    """Bytes of the copy ZeRO-3's ``reduce_scatter_coalesced`` makes of a bucket of ``n`` trainable
    parameters at most (DeepSpeed's default ``reduce_scatter``, or without
    ``contiguous_gradients``): it ``torch.cat``s the gradients, interleaved by rank and padded, into
    one buffer of the bucket's size (a parameter larger than the bucket: its own) in the
    parameters' dtype. MemTracker on a Mistral of 1.3M parameters (2 ranks, fp32, AC on): the peak
    fell by exactly 4 bytes per parameter with ``"reduce_scatter": false``, which reduces in place
    (not memtrain's ZeRO-3 default: that all-reduces, twice a reduce-scatter's communication)."""
    return p_bytes * max(min(n, reduce_bucket_elements), largest_parameter)


def _edge_bytes(p_bytes: int, largest_parameter: int, world_size: int) -> int:
    """Bytes of the parameters ZeRO-1/2 hold whole across a rank's partition edges (their
    gradient buffers are per whole parameter): one largest parameter per edge, one edge per rank
    on 2 ranks, two beyond."""
    return p_bytes * largest_parameter * min(world_size - 1, 2)


def divisors(n: int) -> list[int]:
    """The micro-batch sizes that divide a rank's share of ``n`` samples, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]
