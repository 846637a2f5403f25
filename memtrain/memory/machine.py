"""Facts of the machine a run plans for: the device and host budgets (the host's real limit:
:mod:`memtrain.memory.host_limit`), the device's achieved
matmul rate, CPU Adam's rate, the optimizer's rate per state dtype, a process's own resident
bytes, the host room of offloaded activations, and the seconds an offloading placement's step
spends on CPU Adam and copies at those rates. Measured here when a run plans for
this machine; ``memtrain plan`` may describe another machine instead (its options).
"""

from __future__ import annotations

import functools
import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from memtrain.config import TrainingConfig
from memtrain.memory.host_limit import HostLimit, host_limit, local_ranks
from memtrain.optim import make_optimizer

CUDA_CONTEXT_HOST_BYTES = 2**30
"""Host memory a process's CUDA context and its pinned staging take."""
PLAN_PROCESS_BYTES = 4 * 2**30
"""Host bytes per rank's process assumed by ``memtrain plan`` (a run measures its own)."""
DEFAULT_GPU_FLOPS = 400e12
"""FLOP/s ``memtrain plan`` assumes for a GPU it cannot measure (an H100's achieved dense bf16)."""
REFERENCE_CPU_ADAM_PARAMS_PER_S = 3.3e9
"""Parameters per second ``memtrain plan`` assumes CPU Adam steps on another machine's host when
its rate is not given (``--cpu_adam_params_per_s``): 100 GB/s of host memory bandwidth (about one
server socket's STREAM triad) over the ~30 bytes CPU Adam moves per parameter (fp32 weight and
both moments read and written, the gradient read, the 16-bit weight written). An assumption, not
a measurement: the step times of offloading placements scale with it."""

HOST_DEVICE_BYTES_PER_S = 20e9
"""Host↔device copy rate per rank (pinned memory over PCIe 4/5 x16: 25–50 GB/s peak, ~20 GB/s
sustained by DeepSpeed's transfers)."""
NVME_BYTES_PER_S = 3e9
"""NVMe read/write rate (one PCIe 4 drive, sequential)."""


@dataclass
class Machine:
    """The memory and speeds a placement is planned for.

    Attributes:
        device_bytes: device memory a rank may use (None = unbounded).
        host_bytes: host memory the ranks of one machine may use together (None = unbounded).
        ranks_per_host: ranks sharing that host memory and its CPU cores.
        device_type: ``cuda`` or ``cpu`` (a CPU run's device is host memory too).
        device_flops: achieved FLOP/s of one device.
        cpu_adam_params_per_s: parameters per second CPU Adam steps on this host (all cores).
        process_bytes: host bytes each rank's process uses besides offloaded state.
        nvme_path: a folder for NVMe offload, or None.
        optimizer_params_per_s: ``(state_dtype, device_type) -> parameters per second`` the run's
            AdamW steps with its moments in ``state_dtype`` (:func:`optimizer_params_per_s`, measured
            on first use); None when the machine is not this one (``memtrain plan`` for another):
            a lossier dtype's slower step is then not counted.
        host_step_params_per_s: parameters per second FSDP2's optimizer offload steps on this
            host (:func:`memtrain.backends.optimizer_offload.host_step_params_per_s`, all cores); None =
            ``cpu_adam_params_per_s``.
        host_source: what sets ``host_bytes`` (:attr:`memtrain.memory.host_limit.HostLimit.source`:
            ``available memory``, ``memory.host_memory_gib``, ``RLIMIT_DATA``, a cgroup, or
            ``--host_memory_gib`` for another machine); None = unbounded or not said.
        startup_peak_bytes: the resident peak each rank's process reached before the plan (reading
            and tokenizing the data, importing the libraries: :func:`startup_peak_bytes`), a moment
            of the run already measured that the planned host peak is never below; 0 = not this
            run's process (``memtrain plan``).
        exports: the run writes its export at the end (``checkpoint.export``): its moment, the
            whole model gathered on rank 0's host, is planned.
    """

    device_bytes: Optional[int]
    host_bytes: Optional[int]
    ranks_per_host: int
    device_type: str
    device_flops: float
    cpu_adam_params_per_s: float
    process_bytes: int
    nvme_path: Optional[str] = None
    optimizer_params_per_s: Optional[Callable[[str, str], float]] = None
    host_step_params_per_s: Optional[float] = None
    host_source: Optional[str] = None
    startup_peak_bytes: int = 0
    exports: bool = True

    def as_dict(self) -> dict:
        """The fields as JSON values (the optimizer's rate function as whether there is one)."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        return {**out, "optimizer_params_per_s": "measured" if self.optimizer_params_per_s else None}


def device_budget_bytes(cfg, device: torch.device) -> Optional[int]:
    """Device bytes a rank may use: ``faults.memory_budget_mib`` (the simulated device) when set; on
    CUDA the memory this process can reach (free + reserved by its caching allocator), at most
    ``memory.cuda_memory_cap_gib``; otherwise None (unbounded)."""
    if cfg.faults.memory_budget_mib > 0:
        return int(cfg.faults.memory_budget_mib * 2**20)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        reachable = free + torch.cuda.memory_reserved(device)  # PyTorch's cache is the process's too
        cap = cfg.memory.cuda_memory_cap_gib
        return min(reachable, int(cap * 2**30)) if cap > 0 else reachable
    return None


def cpu_adam_built() -> bool:
    """Whether DeepSpeed's ``cpu_adam`` op loads without compiling: installed prebuilt, or already
    built by an earlier run into torch's extension folder (a first build takes minutes)."""
    return deepspeed_op_built("CPUAdamBuilder")


def deepspeed_op_folders(builder_name: str) -> Optional[list[str]]:
    """The folders torch's JIT build uses for the DeepSpeed op of ``builder_name``
    (``CPUAdamBuilder``, ``ShareMemCommBuilder``: the CPU collectives) on this machine's
    accelerator, those that exist (``<extensions root>/py3XY_<device>/<op>``, or
    ``$TORCH_EXTENSIONS_DIR/<op>`` where that is set; an interrupted build leaves its ``lock``
    there); None when the op loads without a build (installed prebuilt, or no such op for this
    accelerator) or DeepSpeed is not installed."""
    import glob
    import importlib.util
    import os
    import sys

    try:
        from deepspeed.accelerator import get_accelerator
        from torch.utils.cpp_extension import get_default_build_root

        builder = get_accelerator().create_op_builder(builder_name)
        if builder is None:
            return None  # this accelerator has no such op to build
        try:
            if importlib.util.find_spec(builder.absolute_name()) is not None:
                return None
        except ModuleNotFoundError:  # its prebuilt package is not installed either
            pass
        if os.environ.get("TORCH_EXTENSIONS_DIR"):  # torch's JIT folder (only looked at): the user's, as it is
            return glob.glob(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], builder.name))
        return glob.glob(os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}*",
                                      builder.name))  # or torch's own, a folder per Python and device
    except Exception:  # noqa: BLE001 - no DeepSpeed
        return None


def deepspeed_op_built(builder_name: str) -> bool:
    """Whether the DeepSpeed op of ``builder_name`` (``CPUAdamBuilder``, ``ShareMemCommBuilder``:
    the CPU collectives) loads without compiling, for this machine's accelerator: installed
    prebuilt, or already built by an earlier run into torch's extension folder."""
    import os

    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - no DeepSpeed: not built
        return False
    folders = deepspeed_op_folders(builder_name)
    if folders is None:
        return True
    return any(os.path.exists(os.path.join(f, f"{os.path.basename(f)}.so")) for f in folders)


def cpu_adam_params_per_s(n: int = 2**22) -> float:
    """Parameters per second CPU Adam steps on this machine: DeepSpeed's CPU Adam (the optimizer of
    its offload) when its op is built, else torch's AdamW (planning never compiles the op: the
    first build takes minutes); best of 3 steps of ``n`` fp32 parameters."""
    param = torch.nn.Parameter(torch.zeros(n))
    param.grad = torch.full((n,), 1e-3)
    try:
        if not cpu_adam_built():
            raise RuntimeError("DeepSpeed's cpu_adam is not built")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([param], adamw_mode=True)
    except Exception:  # noqa: BLE001 - not built, no compiler, no DeepSpeed: torch's AdamW is the fallback
        opt = torch.optim.AdamW([param], foreach=True)
    opt.step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    return n / best


@functools.cache
def optimizer_params_per_s(state_dtype: str, device_type: str, n: int = 2**20) -> float:
    """Parameters per second memtrain's AdamW (:func:`memtrain.optim.make_optimizer`) steps on this
    machine's ``device_type`` (``cpu|cuda``) with its moments in ``state_dtype`` (``fp32|bf16|int8``):
    the fastest of the steps of one ``n``-element fp32 matrix timed over at least 0.25 s (3 at least,
    after 2 untimed: int8's first step compiles torchao's kernel, seconds once per process). An fp32
    step takes under a millisecond, and a container's CPU quota can stall a process for the rest of
    a 0.1 s period: the window spans several. Measured once per process and arguments.

    Raises:
        memtrain.errors.ConfigError: ``int8`` without torchao installed.
    """
    layer = torch.nn.Linear(1024, n // 1024, bias=False, device=device_type)
    layer.weight.grad = torch.full_like(layer.weight, 1e-3)
    opt = make_optimizer(layer, TrainingConfig(), state_dtype)
    best, timed, spent = float("inf"), -2, 0.0
    while timed < 3 or spent < 0.25:
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device_type == "cuda":
            torch.cuda.synchronize()
        seconds, timed = time.perf_counter() - start, timed + 1
        if timed > 0:
            best, spent = min(best, seconds), spent + seconds
    return n / best


def process_bytes(device_type: str) -> int:
    """Host bytes this process uses now (its resident set), plus a CUDA context not yet created."""
    import psutil

    pending = device_type == "cuda" and not torch.cuda.is_initialized()
    return psutil.Process().memory_info().rss + (CUDA_CONTEXT_HOST_BYTES if pending else 0)


def startup_peak_bytes(device_type: str) -> int:
    """The resident peak this process has reached so far (``getrusage``'s ``ru_maxrss``; KiB on
    Linux, bytes on macOS), plus a CUDA context not yet created, bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    pending = device_type == "cuda" and not torch.cuda.is_initialized()
    return peak + (CUDA_CONTEXT_HOST_BYTES if pending else 0)


def offload_host_room_bytes(cfg, device: torch.device) -> Optional[int]:
    """Host bytes one rank's offloaded activations may take (``memory.activation_offload``): on
    CUDA, the room the host limit (:func:`run_host_limit`) leaves beside what the machine's ranks'
    processes hold, shared by its ranks (``LOCAL_WORLD_SIZE``); None on the simulated device or a
    CPU (one memory: the device budget counts them)."""
    import psutil

    if cfg.faults.memory_budget_mib > 0 or device.type != "cuda":
        return None
    limit = run_host_limit(cfg)
    return max(0, (limit.bytes - limit.ranks * psutil.Process().memory_info().rss) // limit.ranks)


def host_share_bytes(limit: HostLimit, state_bytes: int = 0) -> int:
    """What one rank of a CPU run may use of the host ``limit`` (:func:`run_host_limit`; the
    machine's ranks share it) for model state and activations: its share less what its process
    holds besides ``state_bytes`` of model state it may hold already (the libraries, the data),
    bytes."""
    return max(0, limit.share_bytes - max(0, process_bytes("cpu") - state_bytes))


def run_host_limit(cfg, ranks: Optional[int] = None) -> HostLimit:
    """The host limit of a run of ``cfg`` on this machine: the smallest of ``memory.host_memory_gib``,
    the cgroup's limit, the processes' resource limits and the available memory
    (:func:`memtrain.memory.host_limit.host_limit`), for ``ranks`` processes here (None:
    ``LOCAL_WORLD_SIZE``)."""
    return host_limit(cfg.memory.host_memory_gib, local_ranks() if ranks is None else ranks)


def run_device_budget(cfg, device: torch.device, ranks: Optional[int] = None,
                      state_bytes: int = 0) -> tuple[Optional[int], Optional[HostLimit]]:
    """``(bytes a rank may use on its device, the host limit that sets it)``: the device's
    :func:`device_budget_bytes`, or on a CPU run (whose device is the host) a rank's share of the
    host's real limit (:func:`run_host_limit`, :func:`host_share_bytes` with ``state_bytes`` of
    model state the process may hold already); the limit is None where the device sets it."""
    budget = device_budget_bytes(cfg, device)
    if budget is None and device.type == "cpu":
        limit = run_host_limit(cfg, ranks)
        return host_share_bytes(limit, state_bytes), limit
    return budget, None


def device_flops_per_s(device_type: str) -> float:
    """Achieved dense matmul FLOP/s of this machine's device (a 1024³ fp32 matmul on the CPU, or
    bf16 on CUDA), to turn FLOPs into seconds in ``memtrain plan``."""
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    a = torch.randn(1024, 1024, device=device_type, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ a
        if device_type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * 1024**3 / best
