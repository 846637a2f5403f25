"""The process state: who this process is (rank, world size, device) and the few collectives the
loop itself needs, separate from the engine that trains the model.

It is built first, before data and model (the engine is chosen later, once the model exists).
Accelerate's ``PartialState`` starts the process group from the launcher's environment (torchrun,
``accelerate launch``, the DeepSpeed launcher: nccl on GPU, gloo on CPU); plain ``python`` is a
one-process run with no group until an engine that needs one asks for it (:meth:`ensure_group`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


_GROUPS_STARTED = [0]
"""Process groups :func:`_init_under_torchelastic` has started in this process."""


def _init_under_torchelastic(cpu: bool, timeout: timedelta) -> None:
    """Under one torchrun agent's store (``TORCHELASTIC_USE_AGENT_STORE``, every rank on this
    node), start the process group on a store prefix of its own for each restart
    (``TORCHELASTIC_RESTART_COUNT``).

    Why: the agent keeps one TCP store for every restart of its workers, and a restarted group
    would otherwise read the previous attempt's keys — the dead ranks' gloo addresses ("Connect
    timeout" at start-up) — whenever it reads before its peers wrote. Older torch versions put
    the same ``attempt`` prefix in ``torch.distributed.rendezvous``. With several agents (nodes)
    the restart counts can differ between nodes (an agent whose workers looked healthy restarts
    them without counting), so there the launcher must start a new store each round:
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/operations.md).
    """
    one_agent = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not one_agent or dist.is_initialized():
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    # a later run in this process (predict() after fit()) gets keys of its own too: every rank runs
    # the same runs in the same order, so their counts agree
    _GROUPS_STARTED[0] += 1
    store = dist.PrefixStore(f"memtrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                             f"group_{_GROUPS_STARTED[0]}", store)
    kwargs = {}
    if not cpu and torch.cuda.is_available():
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(kwargs["device_id"])
    # on CUDA also gloo for CPU tensors (FSDP2's CPU offload), as Accelerate would start it
    dist.init_process_group("cuda:nccl,cpu:gloo" if kwargs else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)


class ProcessState:
    """Rank, world size and device of this process, and its collectives.

    Args:
        cpu: run on CPU even where CUDA is present.
        timeout_s: seconds any collective may wait (``backend.timeout_s``): the process group's
            timeout, after which the collective raises (gloo; NCCL with
            ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, else NCCL's watchdog ends the process itself).
            Waits on one rank's long work use :meth:`wait_for_main` instead.

    Attributes:
        rank: 0 … world_size-1.
        world_size: number of processes.
        device: where the model and batches live (``cuda:LOCAL_RANK`` or ``cpu``).
        is_main: rank 0 (writes metrics, commits checkpoints, exports).
    """

    PATIENT_TIMEOUT = timedelta(days=7)
    """The timeout of :meth:`wait_for_main`'s group: no practical limit."""

    def __init__(self, cpu: bool = False, timeout_s: float = 600.0):
        from accelerate import PartialState

        # NCCL: 2 = abort the communicator and raise in Python (exit 6); torchrun sets its own default
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self._launcher_vars: list[str] = []  # what ensure_group set
        self.timeout_s = timeout_s
        _init_under_torchelastic(cpu, timedelta(seconds=timeout_s))
        self._state = PartialState(cpu=cpu, timeout=timedelta(seconds=timeout_s))
        self.rank: int = self._state.process_index
        self.world_size: int = self._state.num_processes
        self.device: torch.device = self._state.device
        self.is_main: bool = self._state.is_main_process
        self._patient = None
        if self.world_size > 1:  # gloo, also beside NCCL: a barrier that waits as long as rank 0 works
            self._patient = dist.new_group(backend="gloo", timeout=self.PATIENT_TIMEOUT)

    def ensure_group(self) -> None:
        """Start a one-process group when none is up (plain ``python`` with a sharded engine, which
        needs a group even alone); also sets the launcher variables DeepSpeed reads."""
        if dist.is_initialized():
            return
        kwargs = {}
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            kwargs["device_id"] = torch.device("cuda", index)
        dist.init_process_group("gloo" if self.device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0,
                                world_size=1, **kwargs)
        for var, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            if var not in os.environ:
                os.environ[var] = value
                self._launcher_vars.append(var)  # removed by close(): a process started later is no rank

    def cap_cuda_memory(self, gib: float) -> None:
        """Limit this process's CUDA memory to ``gib`` GiB (``torch.cuda.set_per_process_memory_fraction``),
        to reproduce a smaller GPU. No-op for ``gib <= 0`` or on CPU."""
        if gib <= 0 or self.device.type != "cuda":
            return
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)

    # -- collectives (every rank calls them at the same point) ----------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def start_all_reduce_sum(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing ``tensor`` over ranks in place without waiting; returns a function that
        waits for the sum and returns ``tensor`` (on a GPU the wait is the stream's, not the host's)."""
        if self.world_size == 1:
            return lambda: tensor
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)

        def result() -> torch.Tensor:
            work.wait()
            return tensor
        return result

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (one all-reduce of MAX)."""
        if self.world_size == 1:
            return bool(flag)
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def broadcast_object(self, obj: Any, patient: bool = False) -> Any:
        """Rank 0's ``obj`` (picklable) on every rank. ``patient``: rank 0 may have worked for longer
        than ``timeout_s`` before sending (the group of :meth:`wait_for_main`)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        if patient:
            dist.broadcast_object_list(box, src=0, group=self._patient)
        else:
            dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Wait for all ranks."""
        if self.world_size > 1:
            dist.barrier()

    def wait_for_main(self) -> None:
        """A barrier for work that only rank 0 does and that may take longer than ``timeout_s``
        (building the data cache, committing or exporting a checkpoint): it waits on a gloo group
        without a practical timeout."""
        if self.world_size > 1:
            dist.barrier(group=self._patient)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the body on rank 0 first, then on the others (for building caches), however long
        rank 0 takes (:meth:`wait_for_main`)."""
        if not self.is_main:
            self.wait_for_main()
        yield
        if self.is_main:
            self.wait_for_main()

    def close(self) -> None:
        """Tear the process group down, and unset the launcher variables :meth:`ensure_group` set (a
        process this one starts later would take itself for rank 0 of 1). Left to interpreter exit,
        communicator threads can abort the process ('terminate called without an active
        exception'). No barrier: after an error on one
        rank it would hang; the others' pending collectives fail instead. Accelerate's run-wide states
        (``AcceleratorState``: mixed precision; ``GradientState``) go with it, so a later run in this
        process (the Python API) sets its own: Accelerate refuses to change an initialized one's
        mixed precision."""
        from accelerate.state import AcceleratorState, GradientState

        if dist.is_initialized():
            deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
            if getattr(deepspeed_comm, "cdb", None) is not None:
                # DeepSpeed's: torch's, and the groups DeepSpeed keeps (a later run in this process,
                # say predict() after fit(), would otherwise reach a destroyed group through them)
                deepspeed_comm.destroy_process_group()
            else:
                dist.destroy_process_group()
        # the patient group is destroyed with the others; its object (its gloo device's thread) goes now,
        # not whenever this state is collected (at interpreter exit, from a Python script's globals)
        self._patient = None
        for var in self._launcher_vars:
            os.environ.pop(var, None)
        self._launcher_vars = []
        AcceleratorState._reset_state()  # PartialState (device, launcher) stays: the next run's is the same
        GradientState._reset_state()


def prepare_libraries(cuda: bool) -> None:
    """Set the libraries up before memtrain uses them: :func:`cache_cpu_info`, and silence what a
    user cannot act on: torch's FutureWarning for the deprecated collectives
    DeepSpeed calls (``all_gather_into_tensor``, ``reduce_scatter_tensor``; 18 lines per ZeRO-3
    run), and, without CUDA, DeepSpeed's "Setting accelerator to CPU" (told so by
    ``DS_ACCELERATOR=cpu`` unless the user set it). When torchao is installed (transformers
    imports it), its warnings on import: kernels of other builds that fail to load, no Triton, and
    torch's notice on how torchao registers two enums."""
    import logging
    import warnings

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cache_cpu_info()


def cache_cpu_info() -> None:
    """Keep py-cpuinfo's first answer for the process. Its ``get_cpu_info`` starts a Python
    subprocess on every call (1.15 s measured on the 2-core CPU machine), and DeepSpeed calls it
    in every ``DeepSpeedCPUAdam`` constructor and op-builder check (importing it at the call), so
    a run with CPU optimizer offload spent ~4.6 s of its start-up on four identical answers. The
    CPU does not change within a process; each caller gets its own copy of the dict."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed not installed: nothing calls it
        return
    if getattr(cpuinfo.get_cpu_info, "memtrain_cached", False):
        return
    first = functools.lru_cache(maxsize=1)(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return dict(first())

    get_cpu_info.memtrain_cached = True
    cpuinfo.get_cpu_info = get_cpu_info
