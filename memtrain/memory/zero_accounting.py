"""DeepSpeed ZeRO's model-state accounting, per rank: the bytes of parameters, gradients, AdamW's
state and DeepSpeed's own buffers by ZeRO stage, offload and precision, and the buffer sizes memtrain
writes into a DeepSpeed config that leaves them unset (:func:`deepspeed_buffer_settings`, the one
source the engine and the accounting both read). The other engines' formulas are in
:mod:`memtrain.memory.accounting`.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

from memtrain.memory.accounting import ADAM_STATE_BYTES
from memtrain.memory.moments import parameter_element_bytes, zero_moments
from memtrain.memory.shape import ModelShape

DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements)."""
DEEPSPEED_PREFETCH_ELEMENTS = 50_000_000
"""DeepSpeed's default ``stage3_prefetch_bucket_size`` (elements)."""
DEEPSPEED_REUSE_ELEMENTS = 1_000_000_000
"""DeepSpeed's default ``stage3_max_reuse_distance`` (elements)."""
ZERO3_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default ``stage3_param_persistence_threshold`` (elements): ZeRO-3 keeps every
parameter of at most this many elements whole on every rank instead of partitioning it."""

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
    it is reduced in place (``reduce_copy`` false; :func:`_zero2_partition_bytes`); under ZeRO-3
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
    rank's gradient partition (:func:`_zero_step_transient`).
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
    bucket = p_bytes * reduce_bucket_elements
    buffers = bucket + off.pop("staging_bytes")
    on_device = offload in (None, "none")
    step = _zero_step_transient(n, w, stage, p_bytes, on_device, reduce_copy, bucket)
    transient, accumulating, backward, step_copy, step_accumulated = step, 0, 0, 0, 0
    if stage == 2 and on_device:
        partition, backward = _zero2_partition_bytes(grads, p_bytes, largest_parameter, w), bucket
        # held from the first reduction to the step; at the step of a plan that accumulates, twice; in
        # 16-bit the step's flattened copy of the partition takes the second's bytes in every plan
        step, grads, accumulating = step + 2 * partition, 0, partition
        step_accumulated = 0 if p_bytes == 2 else partition
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


def _zero_step_transient(n: int, w: int, stage: int, p_bytes: int, on_device: bool, reduce_copy: bool,
                         bucket: int) -> int:
    """Bytes ZeRO holds on the device for the optimizer step only, beside the ``bucket`` bytes of
    reduce bucket that :func:`_zero` counts as a buffer (``n`` trainable parameters, ``w`` ranks,
    ``p_bytes`` per parameter element): the whole gradients' bytes under stages 2 and 3 (the
    bucket's flattened copy), none under ZeRO-2 reducing in place (``reduce_copy`` false, memtrain's
    default: :func:`deepspeed_buffer_settings`).

    With 16-bit parameters the step makes an fp32 copy of the rank's gradient partition, 4 bytes
    per element (stage 1, which keeps its 16-bit gradients whole as state, the same way), and the
    larger of it and the copy counts: MemTracker on GPT-2 small's blocks in bf16 on one rank, 24
    bytes per parameter under ZeRO-3. Under ZeRO-2 on the device it is made after
    ``_release_ipg_buffers`` has freed the bucket at the end of backward, so it takes the
    bucket's place and counts only beyond it; it is made from a flattened copy of the partition
    in the parameters' dtype (``flatten(averaged_gradients)``, then ``.to(fp32)``), held beside
    it, which :func:`_zero` counts as a second partition in every plan (in fp32 ``.to`` copies
    nothing, and the flattened copy, 4 bytes per element, is what counts beyond the bucket).
    MemTracker, 2 ranks, bf16, two micro-batches per step, AC off and on, the 8 families of
    ``memory_accuracy.py --families`` at seeds 7 and 13 (fd15e3a's rows): counted beside the
    bucket, +0.1 … +21.2% over the real peak (Mixtral, seed 13, AC on, +21.2%); in its place
    +0.1 … +5.2%, none under. GPT-2 small's blocks in bf16 on one rank under ZeRO-2, four
    micro-batches per step: 22 bytes per parameter (parameters 2, moments and master 12, partition
    2, its flattened copy 2, the fp32 copy 4)."""
    step = 0 if stage == 2 and on_device and not reduce_copy else (p_bytes * n if stage >= 2 else 0)
    if on_device and (p_bytes == 2 and stage >= 1 or stage == 2):
        step = max(step, 4 * n // w - (bucket if stage == 2 else 0))
    return step


def _zero2_partition_bytes(grads: int, p_bytes: int, largest_parameter: int, world_size: int) -> int:
    """ZeRO-2's gradient partition on the device, in bytes (:func:`_zero`).

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
    return grads + _edge_bytes(p_bytes, largest_parameter, world_size)


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
