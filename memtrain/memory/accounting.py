"""Bytes of model state, written once: per engine, ZeRO stage, offload and precision (parameters,
gradients, AdamW's state), per rank. The engines report what they hold through this module
(``Backend.model_state_bytes``), and the planner, the placement planner and ``memtrain plan`` use
the same functions.
"""

from __future__ import annotations

from typing import Iterable, Optional

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


DEVICE_STATE_KEYS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "buffer_bytes")
"""The keys of a ``model_state_bytes`` dict that are bytes on the device."""

DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements)."""


def zero_reduce_bucket_elements(n_params: int) -> int:
    """The ``reduce_bucket_size`` memtrain writes into a DeepSpeed config that does not set one:
    DeepSpeed's default, but never more than the model's parameters. ZeRO allocates the whole
    bucket as one gradient buffer whatever the model's size (MemTracker counts 1.9 GiB per rank for
    a 2.6M-parameter model under the default); a bucket the size of the model reduces everything
    in one call, which is all a larger one would do."""
    return max(1, min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, n_params))


ZERO3_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default ``stage3_param_persistence_threshold`` (elements): ZeRO-3 keeps every
parameter of at most this many elements whole on every rank instead of partitioning it."""


def zero3_persistent_elements(numels: Iterable[int], threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> int:
    """Elements of the parameters (``numels``: each parameter's element count) that ZeRO-3 keeps
    whole on every rank (DeepSpeed's ``mark_persistent_parameters``)."""
    return sum(n for n in numels if n <= threshold)


def model_state_bytes(engine: str, n_params: int, precision: str, zero_stage: Optional[int] = None,
                      offload: str = "none", world_size: int = 1, offload_optimizer_ratio: float = 1.0,
                      offload_device: str = "cpu", reduce_bucket_elements: Optional[int] = None,
                      persistent_elements: int = 0) -> dict[str, int]:
    """Per-rank bytes of model state for AdamW training under ``engine`` (the formulas below;
    ``offload_optimizer_ratio``, ``offload_device``, ``reduce_bucket_elements`` (None =
    :func:`zero_reduce_bucket_elements`) and ``persistent_elements`` (ZeRO-3's whole small
    parameters: :func:`zero3_persistent_elements`) are DeepSpeed's).

    Returns:
        ``parameter_bytes``, ``gradient_bytes``, ``optimizer_bytes`` and ``buffer_bytes`` (the
        engine's own buffers held through the run: ZeRO's reduce bucket, DDP's gradient buckets)
        on the accelerator
        (:data:`DEVICE_STATE_KEYS`), ``cpu_offloaded_bytes`` in host memory and
        ``nvme_offloaded_bytes`` in NVMe files (all per rank).

    Raises:
        ValueError: an unknown engine.
    """
    if engine == "deepspeed":
        bucket = zero_reduce_bucket_elements(n_params) if reduce_bucket_elements is None else reduce_bucket_elements
        return _zero(n_params, precision, zero_stage, offload, max(1, world_size), offload_optimizer_ratio,
                     offload_device, bucket, persistent_elements)
    if engine not in ("ddp", "fsdp"):
        raise ValueError(f"backend.name: '{engine}' is not one of ddp, fsdp, deepspeed")
    formula = _ddp if engine == "ddp" else _fsdp
    return {"nvme_offloaded_bytes": 0, **formula(n_params, precision, zero_stage, offload, max(1, world_size))}


def device_state_bytes(state_bytes: dict[str, int]) -> int:
    """Model-state bytes on the device, from a ``model_state_bytes`` dict (offloaded bytes excluded)."""
    return sum(state_bytes.get(k, 0) for k in DEVICE_STATE_KEYS)


def _ddp(n_params: int, precision: str, zero_stage, offload: str, world_size: int) -> dict[str, int]:
    """Every rank holds everything: Accelerate's autocast keeps fp32 parameters and gradients
    (cast for compute) and AdamW's two fp32 moments. On more than one rank DDP's reducer also
    allocates its buckets, a second copy of the fp32 gradients (MemTracker: 1.08 MB for a
    0.27M-parameter model on 2 ranks)."""
    n = n_params
    return {"parameter_bytes": 4 * n, "gradient_bytes": 4 * n, "optimizer_bytes": ADAM_STATE_BYTES * n,
            "buffer_bytes": 4 * n if world_size > 1 else 0, "cpu_offloaded_bytes": 0}


def _fsdp(n_params: int, precision: str, zero_stage, offload: str, world_size: int) -> dict[str, int]:
    """fp32 parameters, gradients and AdamW moments, sharded over ranks (FSDP2's mixed-precision
    policy casts for compute); CPUOffloadPolicy moves all three to host memory."""
    n, w = n_params, world_size
    params, grads, optim = 4 * n // w, 4 * n // w, ADAM_STATE_BYTES * n // w
    if offload not in (None, "none"):
        return {"parameter_bytes": 0, "gradient_bytes": 0, "optimizer_bytes": 0, "buffer_bytes": 0,
                "cpu_offloaded_bytes": params + grads + optim}
    return {"parameter_bytes": params, "gradient_bytes": grads, "optimizer_bytes": optim, "buffer_bytes": 0,
            "cpu_offloaded_bytes": 0}


def _zero(n_params: int, precision: str, zero_stage: Optional[int], offload: str, world_size: int,
          offload_optimizer_ratio: float, offload_device: str, reduce_bucket_elements: int,
          persistent_elements: int) -> dict[str, int]:
    """ZeRO's accounting (Rajbhandari et al. 2020, §3.1 and §5), bytes per rank: 16-bit parameters
    and gradients in bf16/fp16 (fp32 otherwise) plus an fp32 master copy kept with AdamW's
    moments; stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters
    (default stage 2).

    Offload (ZeRO-Offload, Ren et al. 2021): the optimizer state leaves the device —
    ``offload_optimizer_ratio`` of it under ZeRO-3's partial offload — and the gradients are
    reduced into host buffers: fp32 partitions under stages 1/2 (stage 1 still holds its whole
    16-bit gradients on the device until the accumulation boundary); under stage 3 a 16-bit
    partition buffer plus the fp32 gradient DeepSpeed keeps beside every optimizer sub-group, on the
    device for the sub-groups stepped there. ``optimizer_and_params`` moves the parameters too.
    With ``offload_device`` ``nvme`` (stage 3) the offloaded optimizer state (with its fp32
    gradients) and parameters are files (``nvme_offloaded_bytes``).

    DeepSpeed's own buffers: the reduce bucket, allocated whole in the parameters' dtype on the
    device (also under offload); ZeRO-3's small parameters (``persistent_elements``), kept whole
    on every rank's device, never partitioned or offloaded."""
    n, w = n_params, world_size
    stage = 2 if zero_stage is None else zero_stage
    half = precision in ("bf16", "fp16")
    p_bytes = 2 if half else 4
    master = 4 if half else 0
    params = p_bytes * n // (w if stage >= 3 else 1)
    grads = p_bytes * n // (w if stage >= 2 else 1)
    optim = (ADAM_STATE_BYTES + master) * n // (w if stage >= 1 else 1)
    host = files = 0
    if offload in ("optimizer", "optimizer_and_params"):
        r = offload_optimizer_ratio
        moved = int(optim * r)
        optim -= moved
        if stage >= 3:  # 16-bit partition buffer on the host; fp32 sub-group gradients where each steps
            host, grads = p_bytes * n // w, int(4 * n / w * (1 - r))
            moved += int(4 * n / w * r)
        else:  # fp32 gradient partitions on the host; stage 1 keeps its full gradients until the boundary
            host, grads = 4 * n // w, grads if stage == 1 else 0
        if offload_device == "nvme":
            files += moved
        else:
            host += moved
    if offload == "optimizer_and_params":
        if offload_device == "nvme":
            files += params
        else:
            host += params
        params = 0
    if stage >= 3:  # the partition of the persistent parameters is in params already, unless offloaded
        whole = p_bytes * persistent_elements
        params += whole if offload == "optimizer_and_params" else whole - whole // w
    return {"parameter_bytes": params, "gradient_bytes": grads, "optimizer_bytes": optim,
            "buffer_bytes": p_bytes * reduce_bucket_elements, "cpu_offloaded_bytes": host,
            "nvme_offloaded_bytes": files}


def divisors(n: int) -> list[int]:
    """The micro-batch sizes that divide a rank's share of ``n`` samples, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]
