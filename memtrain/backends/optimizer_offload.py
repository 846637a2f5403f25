"""AdamW whose fp32 master weights and moments are split between the device and host memory, with
the host part stepped on the CPU while the device runs the next forward: FSDP2's optimizer offload
(``backend.name fsdp``, ``backend.offload optimizer``, ``backend.offload_optimizer_ratio``).

A rank holds its shard of each parameter (and gradient) in the compute dtype on the device. The
optimizer keeps, per shard, AdamW's two moments and — for 16-bit parameters, or for a shard on the
host — an fp32 master copy: on the device for the first parameters of the model (the root's and the
first blocks'), in host memory for the last ``host_ratio`` of the elements. A step:

1. the host part's gradients are copied into one flat host buffer (pinned on a GPU) and a
   background thread starts stepping them on the CPU, unit by unit in the order the next forward
   runs them (the root first), each updated master cast into the buffer and copied back into the
   parameter (on a GPU on a stream of its own; the parameter is marked ready once its copy is done);
2. meanwhile the device part: AdamW in fp32 on the master (the parameter itself when it is fp32),
   written back into the parameter;
3. a forward pre-hook on every FSDP unit waits for that unit's parameters before FSDP gathers them,
   so the CPU step of each block overlaps the forward of the blocks before it (with
   ``overlap=False`` the step waits for the whole host part instead).

The update is torch's AdamW (``torch.optim.adamw.adamw``; its fused kernel on the CPU, whose rate
``benchmarks/host_step_rates.py`` measures beside DeepSpeed's CPU Adam and this step's), in chunks of
:data:`STEP_CHUNK` elements so the fp32 temporaries stay small; with bf16 moments
(``optimizer.state_dtype bf16``) it is :class:`memtrain.optim.AdamWBf16States`' update. Lossless
for fp32 moments: the same arithmetic as a mixed-precision AdamW with fp32 master weights.

The idea of splitting the optimizer state and overlapping the CPU step follows ZeRO-Offload (Ren et
al. 2021, one-step delayed update excluded), DeepSpeed's Twin-Flow partial offload, ZenFlow and
SuperOffload; the update here is never delayed or stale.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Optional

import torch
from torch import nn
from torch.optim.adamw import adamw

from memtrain.memory.accounting import offloaded_parameter_count
from memtrain.optim import AdamWBf16States, _adamw_bf16

STEP_CHUNK = 1 << 20
"""Elements stepped at once: a 16-bit gradient is read into an fp32 scratch of one chunk (4 MiB, one
per device and kept: a fresh one each time costs its page faults), not of the largest parameter."""
STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (in-place updates reach the DTensor), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _shaped_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a state tensor of ``param``: a DTensor with ``param``'s mesh and placements (so
    torch.distributed.checkpoint saves and reshards it as it does the parameter) wherever ``local``
    lives (``DTensor.from_local`` would move a host tensor to the mesh's device), else ``local``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if not isinstance(param, DTensor):
        return local
    spec = DTensorSpec(param.device_mesh, param.placements, tensor_meta=TensorMeta(param.shape, param.stride(),
                                                                                   local.dtype))
    return DTensor(local, spec, requires_grad=False)


def host_split(params: list[torch.Tensor], host_ratio: float) -> set[int]:
    """Ids of the parameters whose optimizer state lives on the host: the last of ``params`` (model
    order) until they hold ``host_ratio`` of all elements (whole parameters, the count of
    :func:`memtrain.memory.accounting.offloaded_parameter_count`, which the planner's bytes use)."""
    count = offloaded_parameter_count([p.numel() for p in params], host_ratio)
    return {id(p) for p in params[len(params) - count:]}


class PartialOffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction; torch's update) with fp32 master weights and
    moments, ``host_ratio`` of them in host memory, stepped on the CPU in a background thread.

    Args:
        param_groups: ``[{"params", "lr", "betas", "eps", "weight_decay"}, ...]`` (those of
            :func:`memtrain.optim.make_optimizer`'s AdamW).
        order: every trainable parameter in model order (the host part is the last of them).
        host_ratio: fraction of the elements whose optimizer state is on the host, in [0, 1].
        state_dtype: the moments' dtype: ``fp32`` (lossless) or ``bf16``.
        overlap: the host step runs on while the next forward starts (:meth:`attach`); False: the
            step returns after it.

    State per parameter: ``step`` (a CPU scalar), ``exp_avg``, ``exp_avg_sq`` and ``master``
    (fp32; absent for an fp32 parameter stepped on the device, which is its own master), each of
    the parameter's shape and sharding (DTensors under FSDP2), on the device or the host.

    Raises:
        ValueError: ``host_ratio`` outside [0, 1] or an unknown ``state_dtype``.
    """

    def __init__(self, param_groups: list[dict], order: list[torch.Tensor], host_ratio: float,
                 state_dtype: str = "fp32", overlap: bool = True):
        if not 0.0 <= host_ratio <= 1.0 or state_dtype not in ("fp32", "bf16"):
            raise ValueError(f"host_ratio {host_ratio} must be in [0, 1], state_dtype {state_dtype} fp32 or bf16")
        groups = [{k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay")} for g in param_groups]
        super().__init__(groups, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
        self.host_ratio, self.state_dtype, self.overlap = host_ratio, state_dtype, overlap
        trainable = {id(p) for g in self.param_groups for p in g["params"]}
        self.order = [p for p in order if id(p) in trainable]
        on_host = host_split(self.order, host_ratio)
        self.host_params = [p for p in self.order if id(p) in on_host]
        self.device_params = [p for p in self.order if id(p) not in on_host]
        # fp32 gradient chunks, one per device and thread (the main thread steps the device part
        # while the worker steps the host part: on a CPU device both on the CPU)
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._buffers: dict[int, torch.Tensor] = {}  # host copies of gradients, then of updated parameters
        self._ready = {id(p): threading.Event() for p in self.host_params}
        device = _local(self.host_params[0]).device if self.host_params else None
        self._executor = None
        if device is not None:  # a new thread's CUDA device is 0: the worker takes the parameters' (no context on GPU 0)
            init = (torch.cuda.set_device, (device,)) if device.type == "cuda" else (None, ())
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="memtrain-host-adam", initializer=init[0],
                                                initargs=init[1])
        self._future: Optional[Future] = None
        self._error: Optional[BaseException] = None  # what the host step in flight raised
        self._hooks: list = []
        self._first_use: dict[int, int] = {}  # parameter id -> the index of the unit whose forward reads it first
        self.host_step_s = 0.0  # the last host step's seconds (the background thread's, copies included)
        for p in self.order:
            self._init_state(p, id(p) in on_host)
        self._allocate_buffers()

    def _init_state(self, p: torch.Tensor, on_host: bool) -> None:
        local = _local(p).detach()
        where = torch.device("cpu") if on_host else local.device
        moment = torch.bfloat16 if self.state_dtype == "bf16" else torch.float32
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = _shaped_like(p, torch.zeros(local.shape, dtype=moment, device=where))
        state["exp_avg_sq"] = _shaped_like(p, torch.zeros(local.shape, dtype=moment, device=where))
        if on_host or local.dtype != torch.float32:
            state["master"] = _shaped_like(p, local.to(device=where, dtype=torch.float32, copy=True))
        if on_host:
            self._buffers[id(p)] = None  # views of one flat buffer (_allocate_buffers)
            self._ready[id(p)].set()

    def _allocate_buffers(self) -> None:
        """The host part's gradient/parameter buffers: views of one flat host tensor in the
        parameters' dtype, pinned when they live on a GPU (torch's pinned allocator rounds each
        block up to a power of two: one block wastes the least)."""
        locals_ = [_local(p) for p in self.host_params]
        if not locals_:
            return
        flat = torch.empty(sum(t.numel() for t in locals_), dtype=locals_[0].dtype,
                           pin_memory=locals_[0].device.type == "cuda")
        offset = 0
        for p, t in zip(self.host_params, locals_):
            self._buffers[id(p)] = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()

    def release_buffers(self) -> None:
        """Free the host part's gradient/parameter buffers (the model's export gathers the whole
        model on rank 0's host beside the optimizer state: ``u`` bytes per host-part element back),
        pinned ones back to the system; the next step allocates them again."""
        self.synchronize()
        self._buffers = dict.fromkeys(self._buffers)
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()

    def attach(self, units: Iterable[nn.Module]) -> None:
        """Wait for each unit's host-stepped parameters before its forward (a forward pre-hook put
        ahead of FSDP's, which gathers them). ``units``: the modules whose forward first reads
        their parameters, in the order the forward runs them (FSDP2's: the root, then every
        repeated block); a parameter is the innermost unit's that holds it. The host step follows
        that order, so the root's parameters (the embeddings and the final norm and head alike)
        are ready first and each block's before its forward."""
        units = list(units)
        owner: dict[int, nn.Module] = {}
        for unit in units:  # outer units first: an inner one takes its parameters over
            for p in unit.parameters():
                owner[id(p)] = unit
        index = {id(unit): i for i, unit in enumerate(units)}
        self._first_use = {id(p): index[id(owner[id(p)])] for p in self.order if id(p) in owner}
        for unit in units:
            mine = [p for p in self.host_params if owner.get(id(p)) is unit]
            if mine:
                self._hooks.append(unit.register_forward_pre_hook(lambda m, a, ps=tuple(mine): self.wait(ps),
                                                                  prepend=True))

    def wait(self, params: Iterable[torch.Tensor] = ()) -> None:
        """Block until ``params`` (default: the whole host part) hold their updated values (on a
        GPU their copies have completed).

        Raises:
            Exception: whatever the host step raised.
        """
        for p in list(params) or self.host_params:
            self._ready[id(p)].wait()
        if self._error is not None:
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for the host step in flight (if any) and raise what it raised."""
        future, self._future = self._future, None
        if future is not None:
            try:
                future.result()
            finally:
                self._error = None

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step: the host part's gradients copied out and its CPU step started in the
        background first, then the device part (see the module)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        jobs, device_jobs = [], []
        for group in self.param_groups:
            hyper = _hyper(group)
            for p in group["params"]:
                if p.grad is not None:
                    (jobs if id(p) in self._buffers else device_jobs).append((p, hyper))
        if jobs:
            self._start_host_steps(jobs)
        for p, hyper in device_jobs:
            self._step_one(p, _local(p.grad), hyper)
        if jobs and not self.overlap:
            self.synchronize()
        return loss

    def _start_host_steps(self, jobs: list) -> None:
        """Copy the host part's gradients into its buffers and hand its step to the thread, in the
        order the next forward needs the parameters (by unit, the root's first, then model order)."""
        if any(b is None for b in self._buffers.values()):
            self._allocate_buffers()  # after release_buffers
        rank = {id(p): (self._first_use.get(id(p), 0), i) for i, p in enumerate(self.order)}
        jobs.sort(key=lambda job: rank[id(job[0])])
        for p, _ in jobs:
            self._buffers[id(p)].copy_(_local(p.grad), non_blocking=True)
        on_gpu = _local(jobs[0][0]).device.type == "cuda"
        copied = torch.cuda.Event(blocking=True) if on_gpu else None  # blocking: the thread sleeps, not spins
        if copied is not None:
            copied.record()
        for p, _ in jobs:
            self._ready[id(p)].clear()
        try:
            self._future = self._executor.submit(self._host_steps, jobs, copied)
        except BaseException:
            for p, _ in jobs:
                self._ready[id(p)].set()
            raise

    @torch.no_grad()  # grad mode is per thread
    def _host_steps(self, jobs: list, copied) -> None:
        """The background thread: each host parameter stepped on the CPU and copied back; on a GPU
        a parameter is marked ready once its copy has completed (FSDP2 reads the shard on a stream
        of its own), the next parameter stepped while it copies."""
        start = time.perf_counter()
        pending = None  # (parameter, its copy's event) in flight
        try:
            if copied is not None:
                copied.synchronize()  # the gradients have reached the host buffers
            stream = torch.cuda.Stream() if copied is not None else None
            for p, hyper in jobs:
                buf = self._buffers[id(p)]
                self._step_one(p, buf, hyper, out=buf)
                if stream is None:
                    _local(p).copy_(buf)
                    self._ready[id(p)].set()
                    continue
                with torch.cuda.stream(stream):
                    _local(p).copy_(buf, non_blocking=True)
                    done = torch.cuda.Event(blocking=True)
                    done.record(stream)
                if pending is not None:
                    pending[1].synchronize()
                    self._ready[id(pending[0])].set()
                pending = (p, done)
            if pending is not None:
                pending[1].synchronize()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            for p, _ in jobs:
                self._ready[id(p)].set()  # a failure is raised by synchronize(), not a hang
            self.host_step_s = time.perf_counter() - start

    def _step_one(self, p: torch.Tensor, grad: torch.Tensor, hyper: dict, out: Optional[torch.Tensor] = None) -> None:
        """AdamW on ``p``'s state with ``grad`` (its local shard), then the new value into ``out``
        (the host buffer) or the parameter."""
        state = self.state[p]
        master = _local(state["master"]) if "master" in state else _local(p)
        m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        step = float(state["step"]) + 1
        flat = [t.reshape(-1) for t in (master, grad, m, v)]
        scratch = None
        if grad.dtype != torch.float32:
            key = (master.device, threading.get_ident())
            scratch = self._scratch.get(key)
            if scratch is None:
                scratch = self._scratch[key] = torch.empty(STEP_CHUNK, device=master.device)
        for i in range(0, flat[0].numel(), STEP_CHUNK):
            chunk = [t[i:i + STEP_CHUNK] for t in flat]
            if scratch is not None:
                chunk[1] = scratch[:chunk[1].numel()].copy_(chunk[1])
            _adamw_chunk(*chunk, step, hyper, self.state_dtype)
        state["step"].fill_(step)
        target = out if out is not None else _local(p)
        if target.data_ptr() != master.data_ptr():
            target.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.order:
            p.grad = None

    def state_dict(self) -> dict:
        """torch's layout (state by parameter index), after the host step in flight."""
        self.synchronize()
        return super().state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Copy saved state into this optimizer's tensors, which keep their place (device or host)
        and dtype (torch's would move every tensor to its parameter's device and dtype). A saved
        state without ``master`` (another engine's AdamW) takes the parameter's values."""
        self.synchronize()
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        if len(saved_ids) != len(params):
            raise ValueError(f"the saved optimizer state has {len(saved_ids)} parameters, this one {len(params)}")
        for p, i in zip(params, saved_ids):
            saved, state = state_dict["state"].get(i, {}), self.state[p]
            if "step" in saved:
                state["step"].fill_(float(saved["step"]))
            for key in STATE_KEYS:
                if key in state:
                    source = saved.get(key, p) if key == "master" else saved.get(key)
                    if source is not None:
                        _local(state[key]).copy_(_local(source))
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def describe(self) -> str:
        """One line: how much of the optimizer state is on the host and how it is stepped."""
        host = sum(p.numel() for p in self.host_params)
        total = sum(p.numel() for p in self.order) or 1
        return (f"{len(self.host_params)} of {len(self.order)} parameters ({host / total:.0%} of the elements) keep "
                f"their fp32 master and {self.state_dtype} moments on the host, stepped on the CPU "
                f"{'beside the next forward' if self.overlap else 'before the step returns'}")

    def state_bytes(self) -> dict[str, int]:
        """Bytes this optimizer holds on the device (``device``) and in host memory (``host``: the
        host part's state and its gradient/parameter buffers)."""
        out = {"device": 0, "host": 0}
        for p in self.order:
            for key in STATE_KEYS:
                t = self.state[p].get(key)
                if t is not None:
                    local = _local(t)
                    out["host" if id(p) in self._buffers else "device"] += local.numel() * local.element_size()
        out["host"] += sum(b.numel() * b.element_size() for b in self._buffers.values() if b is not None)
        return out

    @torch.no_grad()
    def masters_from_parameters(self) -> None:
        """Set every fp32 master to its parameter's value (after weights were loaded from a state
        without masters: another engine's checkpoint)."""
        self.synchronize()
        for p in self.order:
            if "master" in self.state[p]:
                _local(self.state[p]["master"]).copy_(_local(p))

    def close(self) -> None:
        """Finish the step in flight, remove the hooks and stop the thread."""
        try:
            self.synchronize()
        finally:
            for hook in self._hooks:
                hook.remove()
            if self._executor is not None:
                self._executor.shutdown(wait=True)


def _hyper(group: dict) -> dict:
    return {"lr": float(group["lr"]), "beta1": group["betas"][0], "beta2": group["betas"][1], "eps": group["eps"],
            "weight_decay": group["weight_decay"]}


def _adamw_chunk(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: float,
                 hyper: dict, state_dtype: str) -> None:
    """AdamW of step number ``step`` on one chunk (``grad`` fp32), in fp32: torch's fused kernel
    (fp32 moments) or the bf16-moment update of :class:`memtrain.optim.AdamWBf16States`."""
    g = grad
    if state_dtype == "bf16":
        b1, b2 = hyper["beta1"], hyper["beta2"]
        scale = (hyper["lr"] / (1 - b1 ** step), math.sqrt(1 - b2 ** step))
        _adamw_bf16(master, g, m, v, hyper["lr"] * hyper["weight_decay"], b1, b2, hyper["eps"], scale)
        return
    fused = master.device.type in ("cuda", "cpu")
    count = torch.tensor(step - 1) if master.device.type == "cpu" or not fused else _step_count(master.device, step - 1)
    adamw([master], [g], [m], [v], [], [count], fused=fused or None, amsgrad=False, maximize=False, **hyper)


_COUNTS: dict = {}


def _step_count(device: torch.device, value: float) -> torch.Tensor:
    """A step-count tensor on ``device`` holding ``value`` (the fused kernel adds one), reused: a new
    one per chunk would be a blocking host-to-device copy each time."""
    count = _COUNTS.get(device)
    if count is None:
        count = _COUNTS[device] = torch.zeros((), device=device)
    return count.fill_(value)


def from_optimizer(base: torch.optim.Optimizer, model: nn.Module, host_ratio: float,
                   overlap: bool = True) -> PartialOffloadAdamW:
    """A :class:`PartialOffloadAdamW` with ``base``'s groups and hyperparameters (``base``: the
    AdamW of :func:`memtrain.optim.make_optimizer`, not yet stepped; bf16 moments when it is
    :class:`memtrain.optim.AdamWBf16States`).

    Raises:
        ValueError: ``base`` keeps int8 moments (torchao's), which this optimizer does not.
    """
    if not isinstance(base, torch.optim.AdamW):
        raise ValueError("optimizer.state_dtype int8 cannot be offloaded by FSDP2's optimizer offload: choose fp32 "
                         "or bf16")
    state_dtype = "bf16" if isinstance(base, AdamWBf16States) else "fp32"
    return PartialOffloadAdamW(base.param_groups, list(model.parameters()), host_ratio, state_dtype, overlap)


def host_step_params_per_s(n: int = 2**22, dtype: torch.dtype = torch.bfloat16) -> float:
    """Parameters per second this machine's CPU steps the host part (the gradient in ``dtype``
    read, the fp32 AdamW update, the new value written back in ``dtype``): best of 3 after one
    untimed step."""
    p = nn.Parameter(torch.zeros(n, dtype=dtype))
    p.grad = torch.full((n,), 1e-3, dtype=dtype)
    opt = PartialOffloadAdamW([{"params": [p], "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}],
                              [p], 1.0, overlap=False)
    opt.step()
    best = math.inf
    for _ in range(3):
        opt.step()
        best = min(best, opt.host_step_s)
    opt.close()
    return n / best
