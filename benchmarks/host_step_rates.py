"""How fast this machine's CPU steps an optimizer's host part: the rates an offloading placement
is charged (parameters per second), measured rather than assumed.

    python benchmarks/host_step_rates.py --results          # 2^22 parameters, 5 alternating repeats
    python benchmarks/host_step_rates.py --quick            # the plumbing (seconds)

Each repeat times every method once, in turn (alternating, so the machine's drift hits all
alike); a method's time is the best of 3 steps after one untimed step, its CPU seconds (this
process's user + system time over those 3 steps) beside the wall seconds:

- ``offload_host_step``: FSDP2's optimizer offload's own host step
  (:func:`memtrain.backends.optimizer_offload.host_step_params_per_s`: the bf16 gradient read, the fp32
  AdamW update, the bf16 value written back) — what the placement planner charges a run here;
- ``torch_adamw_fused``, ``torch_adamw_foreach``: torch's AdamW on fp32 parameters and gradients
  (the fused CPU kernel, and the multi-tensor one);
- ``deepspeed_cpu_adam``: DeepSpeed's CPU Adam (the optimizer of ZeRO-Offload) where its op is
  built (:func:`memtrain.memory.machine.cpu_adam_built`; never compiled here).

Reported per method: parameters per second (min/median/max over repeats), the same per core
(over ``torch.get_num_threads()``), and CPU seconds per wall second; with the reference rate
``memtrain plan`` assumes for a machine it is not run on
(:data:`memtrain.memory.machine.REFERENCE_CPU_ADAM_PARAMS_PER_S`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import emit, spread  # noqa: E402

from memtrain.memory.machine import REFERENCE_CPU_ADAM_PARAMS_PER_S, cpu_adam_built  # noqa: E402
from memtrain.backends.optimizer_offload import host_step_params_per_s  # noqa: E402


def _timed_steps(step: Callable[[], None]) -> tuple[float, float]:
    """``(best wall seconds, CPU seconds per wall second)`` of 3 calls of ``step`` after one untimed."""
    step()
    best, wall, cpu = float("inf"), 0.0, 0.0
    for _ in range(3):
        c0, w0 = time.process_time(), time.perf_counter()
        step()
        w, c = time.perf_counter() - w0, time.process_time() - c0
        best, wall, cpu = min(best, w), wall + w, cpu + c
    return best, cpu / wall


def torch_adamw(n: int, **kind) -> Callable[[], tuple[float, float]]:
    """A timer of torch's AdamW (``fused=True`` or ``foreach=True``) on ``n`` fp32 parameters."""
    def timer():
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.full((n,), 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **kind)
        return _timed_steps(opt.step)
    return timer


def deepspeed_cpu_adam(n: int) -> Optional[Callable[[], tuple[float, float]]]:
    """A timer of DeepSpeed's CPU Adam on ``n`` fp32 parameters; None where its op is not built."""
    if not cpu_adam_built():
        return None

    def timer():
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.full((n,), 1e-3)
        opt = DeepSpeedCPUAdam([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, adamw_mode=True)
        return _timed_steps(opt.step)
    return timer


def offload_host_step(n: int) -> Callable[[], tuple[float, float]]:
    """A timer of the optimizer offload's host step (its own best of 3 after one untimed step)."""
    def timer():
        c0, w0 = time.process_time(), time.perf_counter()
        rate = host_step_params_per_s(n)
        return n / rate, (time.process_time() - c0) / (time.perf_counter() - w0)
    return timer


def measure(n: int, repeats: int) -> dict:
    """The rows' body: each method's rates over ``repeats`` alternating repeats."""
    timers = {"offload_host_step": offload_host_step(n), "torch_adamw_fused": torch_adamw(n, fused=True),
              "torch_adamw_foreach": torch_adamw(n, foreach=True), "deepspeed_cpu_adam": deepspeed_cpu_adam(n)}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, t in timers.items() if t is not None}
    for _ in range(repeats):
        for name in runs:
            runs[name].append(timers[name]())
    threads = torch.get_num_threads()
    methods = {}
    for name, seconds in runs.items():
        rates = [n / s for s, _ in seconds]
        methods[name] = {"params_per_s": spread(rates), "params_per_s_per_core": spread([r / threads for r in rates]),
                         "cpu_s_per_wall_s": spread([c for _, c in seconds])}
    return {"parameters": n, "repeats": repeats, "threads": threads,
            "reference_params_per_s": REFERENCE_CPU_ADAM_PARAMS_PER_S, "methods": methods,
            "not_measured": {name: "DeepSpeed's cpu_adam op is not built here" for name, t in timers.items() if t is None}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parameters", type=int, default=2**22)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2^16 parameters, 2 repeats: the plumbing")
    ap.add_argument("--results", action="store_true", help="append to benchmarks/results/")
    args = ap.parse_args(argv)
    n, repeats = (2**16, 2) if args.quick else (args.parameters, args.repeats)
    emit("host_step_rates", "cpu", {"benchmark": "host_step_rates", "device": "cpu", "quick": args.quick,
                                    **measure(n, repeats)}, args.results and not args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
