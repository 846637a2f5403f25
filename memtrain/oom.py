"""Out-of-memory errors and the rank-synchronised decision about them (the OOM protocol).

Every rank must reach the same decision for the same step: an OOM on one rank makes all ranks
discard the step's partial gradients, adopt the same smaller plan (:mod:`memtrain.plan`) and
retry the same samples, and no rank may be left waiting in a collective of the engine (DDP's
bucket all-reduce, FSDP2's all-gather / reduce-scatter, ZeRO-3's parameter fetch). The means:
*agreement points* (:class:`OOMSync`) at which every rank all-reduces an OOM flag, placed so that
no engine collective lies between two of them. The approach follows Composer's auto-microbatching
(an all-reduced OOM flag, plus hooks inside FSDP models), made to work for every engine here.
"""

from __future__ import annotations

import errno
import json
import os
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from memtrain.backends import engine_module
from memtrain.errors import OOMStop
from memtrain.folders import ESCAPED_OOM_PREFIX, write_atomic
from memtrain.host_flags import host_flags
from memtrain.levers import LEVERS

if TYPE_CHECKING:
    from memtrain.config import FaultsConfig

_OOM_MESSAGES = ("out of memory", "CUDNN_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED",
                 "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE")
_HOST_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "can't allocate memory",
                      "Cannot allocate memory", "cudaHostAlloc", "CUDAHostAllocator")
"""Host allocation failures: torch's CPU allocator (``posix_memalign`` failing, errno 12 ENOMEM:
past ``RLIMIT_DATA``/``RLIMIT_AS`` or with overcommit refused), a pinned-memory allocation
(``cudaHostAlloc``), an ``mmap`` that returned ENOMEM. Accelerate's ``should_reduce_batch_size``
treats the first as out-of-memory too."""


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error, of the device or of the host:
    ``torch.OutOfMemoryError``, a RuntimeError carrying a CUDA/cuDNN/cuBLAS allocation-failure
    message or a host allocation failure (:func:`is_host_oom`). Anything else is not (and is
    re-raised untouched by the loop)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return is_host_oom(exc) or (isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES))


def is_host_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure to allocate host memory: a ``MemoryError`` (Python's, or
    NumPy's), an ``OSError`` with errno ENOMEM (``mmap``), a library the loader could not map, or
    an error carrying a host allocator's failure message (:data:`_HOST_OOM_MESSAGES`: torch's CPU
    allocator, a pinned allocation)."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    if isinstance(exc, ImportError) and "failed to map segment" in str(exc):
        return True  # the dynamic loader's mmap of a library refused (ENOMEM under a resource limit)
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _HOST_OOM_MESSAGES)


def memory_that_ran_out(exc: Optional[BaseException], device_type: str) -> str:
    """``host`` or ``device``: which memory ``exc`` ran out of on a run whose device is
    ``device_type`` (a CPU run's device is the host; another rank's agreed OOM, ``exc`` None or
    :class:`AgreedOOM`, on an accelerator is taken for the device's)."""
    if device_type == "cpu":
        return "host"
    return "host" if exc is not None and not isinstance(exc, AgreedOOM) and is_host_oom(exc) else "device"


class AgreedOOM(torch.OutOfMemoryError):
    """Raised on every rank once the ranks have agreed that some rank ran out of memory.

    Attributes:
        ranks: the ranks that ran out of memory.
    """

    def __init__(self, ranks: list[int]):
        self.ranks = ranks
        super().__init__(f"out of memory on rank(s) {ranks}")


def first_tensor(x) -> Optional[torch.Tensor]:
    """The first tensor in a block's inputs or outputs (a tensor, a tuple/list, or a transformers
    output with ``last_hidden_state``), or None."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x:
        return first_tensor(x[0])
    return getattr(x, "last_hidden_state", None) if x is not None else None


class _AfterBackward(torch.autograd.Function):
    """Identity on a block's input whose backward calls ``callback()`` once the block's backward
    has computed the input's gradient: before the collectives an engine runs after a block's
    backward (FSDP2's reduce-scatter, whose own function wraps the same input earlier in forward,
    so runs later in backward)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


def register_block_hooks(blocks: list[nn.Module], forward: Callable, backward: Callable,
                         after_backward: Optional[Callable] = None) -> None:
    """Hooks that run before each block's forward and before its backward, ahead of any hook the
    engine registered (``prepend``), so they run before the engine's collectives; and, where
    ``after_backward`` is given, after each block's backward, before the engine's post-backward
    collectives.

    Args:
        blocks: the repeated blocks, in forward order.
        forward: ``forward(index, hidden [B, …] tensor, args, kwargs)`` before the block's forward;
            may return ``(args, kwargs)`` to replace the inputs.
        backward: ``backward(index, shape)`` when the gradient of the block's output arrives
            (before the block's own backward).
        after_backward: ``after_backward(index)`` when the block's backward has computed the
            gradient of its input (its first positional tensor, or ``hidden_states``); None = none.
    """
    for i, block in enumerate(blocks):
        def pre(module, args, kwargs, index=i):
            h = first_tensor(args) if args else first_tensor(next(iter(kwargs.values()), None))
            return forward(index, h, args, kwargs) if h is not None else None

        def post(module, args, output, index=i):
            h = first_tensor(output)
            if h is not None and h.requires_grad:
                shape = h.shape
                h.register_hook(lambda grad: backward(index, shape))

        def wrap_input(module, args, kwargs, index=i):  # after the engine's pre-forward hook: runs before it in backward
            call = lambda: after_backward(index)  # noqa: E731
            if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                return (_AfterBackward.apply(args[0], call), *args[1:]), kwargs
            h = kwargs.get("hidden_states")
            if isinstance(h, torch.Tensor) and h.requires_grad:
                return args, {**kwargs, "hidden_states": _AfterBackward.apply(h, call)}
            return None

        block.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        block.register_forward_hook(post, prepend=True)
        if after_backward is not None:
            block.register_forward_pre_hook(wrap_input, with_kwargs=True)


def agrees_inside_compute(device_type: str, faults: "FaultsConfig", host_limited: bool = False) -> bool:
    """Whether a run's OOM agreement points inside compute are made (:class:`OOMSync`'s
    ``inside_compute``): on an accelerator (``device_type`` not ``cpu``), where its allocator raises
    out-of-memory errors; on the CPU where the host is held to a limit past which an allocation
    fails (``host_limited``: :attr:`memtrain.memory.host_limit.HostLimit.fails_allocations`, a
    resource limit), where ``faults`` (:class:`memtrain.config.FaultsConfig`) can raise
    one (``memory_budget_mib``, ``oom_above_tokens``) or ``arm_oom_agreements`` asks. Without a
    limit a CPU allocation seldom fails: the kernel's OOM killer ends the process first."""
    return (device_type != "cpu" or host_limited or faults.memory_budget_mib > 0 or faults.oom_above_tokens > 0
            or faults.arm_oom_agreements)


class OOMSync:
    """Agreement points of the OOM protocol.

    Every rank calls :meth:`agreement_point` at the same places: before every block's forward
    and backward where the engine communicates there (:meth:`install`, switched per micro-batch
    by :meth:`expect`), after a micro-batch when the next one communicates, and once at the end
    of the step (:meth:`closing_point`, where the step's sums and the stop flag travel in the
    same all-reduce). A rank that ran out of memory skips ahead to the loop, which calls
    :meth:`agree` with ``local_oom=True``; that collective pairs with the other ranks' next
    agreement point, which then raise :class:`AgreedOOM`. Because no engine collective sits
    between two agreement points, nobody is left waiting in one.

    When every rank runs on this host an agreement is a barrier in shared memory
    (:mod:`memtrain.host_flags`, tens of microseconds) that also sums the payload. Otherwise
    every agreement is one all-reduce of ``world_size`` flags and :data:`PAYLOAD_SLOTS` values,
    float64 on the CPU (one gloo round trip). Neither synchronises the device: running out of
    memory is a host-side event, raised where the host allocates. On a CUDA run the all-reduces
    have a gloo group of their own beside NCCL.

    The points inside compute (block hooks, between micro-batches, after each evaluation batch)
    guard only against an OOM raised there; where none is expected (``inside_compute`` False: a CPU
    run whose host is held to no limit, without injected faults, :func:`agrees_inside_compute`)
    they are not made, and each step agrees once, at its close. On 2 CPU ranks under FSDP2 they cost 3–7% of
    the step time (docs/benchmarks.md, loop overhead).

    Args:
        world_size: number of ranks; rank: this rank.
        enabled: False = no agreement (``memory.oom_recovery`` off).
        device: the run's device (CUDA: a gloo group is made for the agreements).
        timeout_s: that group's collective timeout (``backend.timeout_s``), seconds.
        inside_compute: whether the points inside compute are made (see above).
    """

    PAYLOAD_SLOTS = 4
    """Values summed over ranks with the flags: the step's loss sum, the two halves of its data
    fingerprint (:func:`memtrain.step.close_step`) and the stop flag."""

    def __init__(self, world_size: int, rank: int, enabled: bool = True, device: Optional[torch.device] = None,
                 timeout_s: float = 600.0, inside_compute: bool = True):
        self.world_size, self.rank = world_size, rank
        self.enabled, self.inside_compute = enabled, inside_compute
        self.stop_source: Callable[[], bool] = lambda: False
        self.stop_agreed = False  # some rank's stop_source was set at the last closing agreement
        self._expect = None  # the coming micro-batch's ComputeCollectives; None = the hooks do not agree
        self._group = None
        if self.active and device is not None and device.type != "cpu":
            from datetime import timedelta

            self._group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        # ranks on one host agree through shared memory (memtrain.host_flags), payloads included
        self._flags = host_flags(world_size, rank, timeout_s, self._group, self.PAYLOAD_SLOTS) if self.active else None
        self.agreements = 0  # agreement points passed (for tests and benchmarks)

    @property
    def active(self) -> bool:
        """Whether agreement points communicate (recovery on, more than one rank)."""
        return self.enabled and self.world_size > 1

    @property
    def transport(self) -> str:
        """``shared_memory`` (every rank on this host), ``all_reduce`` or ``none`` (inactive)."""
        return "none" if not self.active else "shared_memory" if self._flags is not None else "all_reduce"

    def _agree(self, local_oom: bool, payload: Optional[torch.Tensor] = None, stop: bool = False
               ) -> tuple[list[int], Optional[torch.Tensor], bool]:
        """One agreement: (the ranks that ran out of memory, the payload summed over ranks unless
        some rank did, whether any rank's ``stop`` was set)."""
        self.agreements += 1
        if self._flags is not None:
            values = payload.numpy() if payload is not None else None
            ranks, stop_any, summed = self._flags.exchange(local_oom, stop, values)
            return ranks, torch.from_numpy(summed) if summed is not None else None, stop_any
        buffer = torch.zeros(self.world_size + self.PAYLOAD_SLOTS, dtype=torch.float64)
        buffer[self.rank] = float(local_oom)
        if payload is not None:
            buffer[self.world_size:self.world_size + payload.numel()] = payload
        buffer[-1] += float(stop)
        torch.distributed.all_reduce(buffer, group=self._group)
        flags = buffer[:self.world_size].tolist()  # a CPU tensor: no device synchronisation
        return [r for r, f in enumerate(flags) if f], buffer[self.world_size:], bool(buffer[-1] > 0)

    def agree(self, local_oom: bool) -> list[int]:
        """One agreement point from the loop; returns the ranks that ran out of memory."""
        if not self.active:
            return [self.rank] if local_oom else []
        return self._agree(local_oom)[0]

    def agreement_point(self, payload: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """An agreement point on the success path.

        Args:
            payload: up to ``PAYLOAD_SLOTS - 1`` float64 CPU values to sum over ranks with the
                agreement (None = none).

        Returns:
            The payload summed over ranks ([PAYLOAD_SLOTS] float64, CPU), or None when there is
            no payload or the points do not communicate.

        Raises:
            AgreedOOM: another rank ran out of memory since the last agreement point.
        """
        if not self.active:
            return None
        ranks, summed, _ = self._agree(False, payload)
        if ranks:
            raise AgreedOOM(ranks)
        return summed

    def compute_point(self) -> None:
        """An agreement point inside compute (between micro-batches, after an evaluation batch):
        :meth:`agreement_point` where ``inside_compute``, else nothing.

        Raises:
            AgreedOOM: as :meth:`agreement_point`."""
        if self.inside_compute:
            self.agreement_point()

    def closing_point(self, payload: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The step's last agreement point; it also carries this rank's stop flag
        (:attr:`stop_source`: a stop signal arrived) and sets :attr:`stop_agreed` from every rank's.

        Args/Returns/Raises: as :meth:`agreement_point`."""
        if not self.active:
            return None
        ranks, summed, self.stop_agreed = self._agree(False, payload, bool(self.stop_source()))
        if ranks:
            raise AgreedOOM(ranks)
        return summed

    def close(self) -> None:
        """Release the shared agreement words (if any)."""
        if self._flags is not None:
            self._flags.close()
            self._flags = None

    def expect(self, collectives) -> None:
        """Where the block hooks agree during the coming micro-batch: ``collectives`` is the
        engine's :class:`memtrain.backends.base.ComputeCollectives` ``(forward, backward,
        backward_blocks)``."""
        self._expect = collectives

    def install(self, blocks: list[nn.Module], collectives, root: Optional[nn.Module] = None) -> None:
        """Agreement hooks before every block's training forward and backward, when the engine
        communicates inside compute on some micro-batch (``collectives``, the union over
        micro-batches, ``.any``) and points inside compute are made; else nothing is registered
        (a plain DDP run pays for no Python hook). Each agrees only where :meth:`expect` says the
        current micro-batch communicates.
        A point also follows each block's backward, before the engine's post-backward
        collectives (FSDP2's reduce-scatter): a rank that ran out of memory inside a block's
        backward must not leave the others in that block's reduction. And one where the
        gradient of the ``root`` model's outputs arrives, before the engine's pre-backward hook on
        them (FSDP2's root gathers and prefetches there), where its backward communicates before the
        first block's: a rank that ran out of memory in the loss's backward (the logits' gradient,
        often the step's largest tensor) must not leave the others in that gather.
        Install after the engine wrapped the model, so these run before its hooks. Evaluation
        forwards agree once per micro-batch instead (in the evaluator, :meth:`compute_point`)."""
        if not (self.active and self.inside_compute and collectives.any):
            return

        def forward(index, hidden, args, kwargs):
            if self._expect is not None and self._expect.forward and torch.is_grad_enabled():
                self.agreement_point()

        def backward(index, *_):
            e = self._expect
            if e is not None and e.backward and (e.backward_blocks is None or index in e.backward_blocks):
                self.agreement_point()

        register_block_hooks(blocks, forward, backward, after_backward=backward)
        if root is not None:
            root.register_forward_hook(self._root_output_hook, prepend=True)

    def _root_output_hook(self, module, args, output) -> None:
        """On the root's grad-requiring outputs, a gradient hook that agrees once per backward,
        before the engine's own hooks on them (registered after this, in its post-forward hook)."""
        tensors = [t for t in (output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list))
                               else (output,)) if isinstance(t, torch.Tensor) and t.requires_grad]
        e, fired = self._expect, []
        if not tensors or e is None or not (e.backward and e.backward_blocks is None):
            return

        def agree_once(grad):
            if not fired:
                fired.append(True)
                self.agreement_point()

        for t in tensors:
            t.register_hook(agree_once)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far, in bytes: CUDA max allocated on a GPU, else the
    process's peak resident set size (``ru_maxrss``)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def memory_report(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes held by parameters, gradients and optimizer state on this rank (local shards for
    sharded engines), plus peak memory so far.

    Returns:
        ``parameter_bytes``, ``gradient_bytes``, ``optimizer_bytes``, ``peak_memory_bytes``.
    """
    def local(t):
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    opt_bytes = 0
    for state in getattr(optimizer, "state", {}).values():
        opt_bytes += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor))
    device = params[0].device if params else torch.device("cpu")
    return {
        "parameter_bytes": sum(local(p) for p in params),
        "gradient_bytes": sum(local(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": opt_bytes,
        "peak_memory_bytes": peak_memory_bytes(device),
    }


def oom_stop_message(exc: OOMStop, step: int, rank: int, report: dict[str, int], context: dict) -> str:
    """The message of the run-ending :class:`OOMStop`: which memory ran out (host or device),
    where, the budget that was hit, the memory report (MiB), what was already on, and only the
    changes that are left.

    Args:
        report: :func:`memory_report` (its ``peak_memory_bytes`` is named for what it is: the
            device's peak allocation on CUDA, the process's peak resident size on the CPU).
        context: ``engine``, ``zero_stage``, ``offload``, each lever's setting by its name
            (:data:`memtrain.levers.LEVERS`; a missing one is the lever's default), ``device_type``,
            ``memory`` (``host|device``, :func:`memory_that_ran_out`), ``host_limit`` (the run's
            :class:`memtrain.memory.host_limit.HostLimit`, or None), and, where known,
            ``budget_bytes`` (the simulated device's or the CUDA cap) and ``simulated_peak_bytes``.
            The engine (its module's ``stop_words``/``stop_advice``) and each lever
            (:meth:`memtrain.levers.base.Lever.stop_words`/``stop_advice``) say what was on and
            what is left.
    """
    mib = lambda v: f"{v / 2**20:.1f} MiB"  # noqa: E731
    peak_name = "device peak allocated" if context.get("device_type") == "cuda" else "process peak resident size"
    shown = {**{k: v for k, v in report.items() if k != "peak_memory_bytes"}, peak_name: report.get("peak_memory_bytes", 0)}
    budget, memory, limit = context.get("budget_bytes"), context.get("memory", "device"), context.get("host_limit")
    hit = (f" The budget is {mib(budget)} per rank" + (f" (simulated device peak {mib(context['simulated_peak_bytes'])})"
                                                        if context.get("simulated_peak_bytes") else "") + "."
           if budget else f" The host limit is {limit.describe()}." if memory == "host" and limit is not None else "")
    engine = engine_module(context["engine"])
    on = [engine.stop_words(context)] + [x.stop_words(context.get(x.name)) for x in LEVERS]
    left = engine.stop_advice(context) + [x.stop_advice(context.get(x.name), engine) for x in LEVERS]
    left.append("a shorter data.seq_len")
    if memory == "host" and not context.get("simulated_peak_bytes"):
        left.append(f"more host memory for each rank ({limit.source if limit is not None else 'the machine'}), "
                    "or fewer ranks on this machine")
    return (f"{memory.capitalize()} memory ran out: {exc} at step {step} (rank {rank}).{hit} Memory on this rank: "
            + ", ".join(f"{k} = {mib(v)}" for k, v in shown.items())
            + f". Already on: {', '.join(w for w in on if w)}. To fit: {'; '.join(w for w in left if w)}.")


def escaped_oom_path(output_dir: str, rank: int) -> str:
    """Where :func:`record_escaped_oom` notes ``rank``'s escaped OOM."""
    return os.path.join(output_dir, f"{ESCAPED_OOM_PREFIX}.rank{rank}.json")


def record_escaped_oom(output_dir: str, rank: int, step: int, plan: str) -> None:
    """Note that this rank ran out of memory outside the OOM protocol (e.g. in the optimizer
    step) at ``step`` with ``plan``, before the process exits, so that a restarted run
    (``torchrun --max-restarts``) starts at a smaller plan (:func:`take_escaped_ooms`)."""
    os.makedirs(output_dir, exist_ok=True)
    write_atomic(escaped_oom_path(output_dir, rank), json.dumps({"rank": rank, "step": step, "plan": plan}))


def take_escaped_ooms(output_dir: str) -> list[dict]:
    """The records of :func:`record_escaped_oom` in ``output_dir`` (rank order), removed as they
    are read. Rank 0 only; the caller broadcasts the result."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in sorted(n for n in os.listdir(output_dir) if n.startswith(ESCAPED_OOM_PREFIX + ".")):
        path = os.path.join(output_dir, name)
        with open(path) as fh:
            found.append(json.load(fh))
        os.remove(path)
    return found
