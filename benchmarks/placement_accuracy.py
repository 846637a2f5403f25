"""The placement planner's model-state bytes beside what DeepSpeed really allocates.

``memtrain plan`` and ``backend.offload auto`` size every DeepSpeed placement with the closed-form
accounting of :func:`memtrain.backends.model_state_bytes` (ZeRO's formulas plus the
buffers memtrain sets). This benchmark builds the real engine — ``memtrain/train.py`` on 2 CPU
ranks (gloo), 2 steps of global batch 8 in micro-batches of 2 (accumulation 2), DeepSpeed's own
``initialize`` — and counts the tensors DeepSpeed holds, per
component:

- **How it is counted.** Every tensor reachable from the ZeRO optimizer object (its flat
  partitions, buckets, offload buffers, the inner optimizer's state) and from the model's
  parameters (their data, ZeRO-3's ``ds_tensor`` partitions, ``.grad``), each storage once,
  classified by the DeepSpeed attribute that holds it (:data:`COMPONENTS`; anything unknown is
  ``other`` and listed by attribute). Counted after ``initialize``, at the entry and exit of the
  last backward's gradient-partition epilogue (the whole gradients and the reduce bucket are live
  there) and after each optimizer step; a component's measured bytes are its largest count. ZeRO-3's
  gathered parameters are counted after every fetch of DeepSpeed's parameter coordinator (the
  submodule's and the prefetched ones): the largest sum of the partitioned parameters held whole. The
  process's resident set is reported beside, not compared (it holds the libraries and the data),
  and so are the bytes of live tensors the walk did not reach after the step (every tensor the
  garbage collector knows minus those counted: the data batch, the model's own buffers, or a
  DeepSpeed buffer held out of the walk's reach).
- **What is predicted.** The placement planner's accounting for the same placement, model shape,
  precision and world size (:func:`memtrain.planning.placement.state_bytes`): parameters =
  ``parameter_bytes`` + the offloaded parameters; gradients = ``gradient_bytes`` + the held part
  of ``step_gradient_bytes`` + the offloaded gradients; optimizer state = ``optimizer_bytes`` +
  the offloaded optimizer state; buffers = ``buffer_bytes`` without the gathered parameters + the
  offloaded staging buffers. On a CPU host and device are one memory, so each component is
  compared wherever it lives.
- **What is not compared here.** Three terms of the accounting are peaks inside the step, not
  tensors DeepSpeed keeps: the whole gradients of ``step_gradient_bytes`` (DeepSpeed copies each
  gradient into the reduce bucket and keeps a view, so the census finds them as the bucket),
  ZeRO-3's copy of the bucket while it is reduce-scattered (``step_reduce_copy_bytes``) and
  ZeRO-3's gathered parameters (reported as a ``gathered`` row: the accounting's bound against the
  most the coordinator held after a fetch). Both are in the step's peak, which torch's MemTracker
  counts whole in ``benchmarks/memory_accuracy.py``.

One JSON row per (model size, placement, component), rank 0:

    size, parameters, placement, component, predicted_bytes, measured_bytes, relative_error

with components ``parameters``, ``gradients``, ``optimizer_state``, ``buffers``, ``other`` (held
by DeepSpeed, in no component; only when there is any), ``gathered`` (ZeRO-3) and last ``total``
(the held components), and a ``summary`` row: the largest |relative_error| of a held component
and of a total. Goal: every held component within 10%, every total within 5%. A run that fails
(e.g. two ranks of the largest model past this machine's memory) is a ``failed`` row with its exit
code, and the benchmark goes on.

    python benchmarks/placement_accuracy.py              # 25M, 86M and 300M-parameter GPT-2s, 6 placements each
    python benchmarks/placement_accuracy.py --quick      # the runs of QUICK (prints only; the tests run it)
    python benchmarks/placement_accuracy.py --results    # also append the rows to benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CPU_ARGS, RunFailed, emit, run_memtrain, scratch_dir  # noqa: E402

SIZES = {  # GPT-2 shapes on the corpus's 1024-token vocabulary: (layers, width, heads)
    "1.8M": (2, 256, 4), "25M": (8, 512, 8), "86M": (12, 768, 12), "300M": (24, 1024, 16)}
DS = ["--backend.name", "deepspeed"]
PLACEMENTS = {  # name -> memtrain arguments (the placement planner's variants, memtrain's engine names)
    "ddp": ["--backend.name", "ddp"],  # host peak only (DDP's state is torch's own: no census)
    "fsdp": ["--backend.name", "fsdp"],
    "zero2": [*DS, "--backend.zero_stage", "2"],
    "zero2 optimizer→host": [*DS, "--backend.zero_stage", "2", "--backend.offload", "optimizer"],
    "zero3": [*DS, "--backend.zero_stage", "3"],
    "zero3 optimizer→host": [*DS, "--backend.zero_stage", "3", "--backend.offload", "optimizer"],
    "zero3 optimizer 50%→host": [*DS, "--backend.zero_stage", "3", "--backend.offload", "optimizer",
                                 "--backend.offload_optimizer_ratio", "0.5"],
    "zero3 optimizer+params→host": [*DS, "--backend.zero_stage", "3", "--backend.offload", "optimizer_and_params"],
    "fsdp optimizer 50%→host": ["--backend.name", "fsdp", "--backend.offload", "optimizer",
                                "--backend.offload_optimizer_ratio", "0.5"],
    "fsdp optimizer+params→host": ["--backend.name", "fsdp", "--backend.offload", "optimizer_and_params"],
}
QUICK = [("1.8M", "ddp"), ("1.8M", "zero3 optimizer 50%→host"), ("1.8M", "fsdp optimizer 50%→host"),
         ("1.8M", "fsdp optimizer+params→host"), ("25M", "fsdp"), ("25M", "zero2 optimizer→host")]
"""(size, placement) runs of ``--quick``: each engine's offloads at the smallest size (where a
rank's resident peak is its start-up's), and two 25M runs where it is the step's (the blocks a
step frees, returned to the OS; ZeRO-2's whole gradients under offload)."""
FULL = [(size, placement) for size in ("25M", "86M", "300M") for placement in PLACEMENTS]
COMPONENTS = (  # (component, pattern on the attribute path), first match wins
    ("gathered", r"^gathered$"),
    ("buffers", r"ipg|bucket|temp_grad_buffer|param_buffer_of_bit16|optimizer\._buffers|optimizer\._scratch"),
    ("gradients", r"\.grad$"),
    ("parameters", r"^param|\.ds_tensor$|bit16_groups|fp16_partitioned_groups_flat|fp16_groups|persistent_parameters"),
    ("optimizer_state", r"\.state\[|single_partition_of_fp32_groups|fp32_partitioned_groups_flat\[\]$"
                        r"|param_groups\[\]\[params\]|backup_optimizer"),
    ("gradients", r"grad"),
)
NAMES = ("parameters", "gradients", "optimizer_state", "buffers", "other")
"""The held components (the ``total`` adds them up; ZeRO-3's ``gathered`` parameters are apart)."""
STEPS = 2  # the second step's counts hold everything: AdamW's moments exist from the first
ACCUMULATION = 2  # global batch 8 = micro-batch 2 × 2 ranks × 2: the accumulation buffers are counted too


def component(path: str) -> str:
    """The component of a tensor held at attribute ``path`` (:data:`COMPONENTS`; else ``other``)."""
    return next((name for name, pattern in COMPONENTS if re.search(pattern, path)), "other")


def _walk(obj, path: str, found: dict, seen: dict, depth: int = 0) -> None:
    """Record in ``found`` (storage → (path, bytes)) every tensor storage reachable from ``obj``
    through DeepSpeed/torch.optim objects, lists, tuples and dicts (modules excluded). ``seen``
    holds every object walked, by id, alive (a temporary such as ``p.data`` would free its id for
    the next one)."""
    import torch

    from torch.distributed.tensor import DTensor

    if depth > 6 or id(obj) in seen:
        return
    seen[id(obj)] = obj
    if isinstance(obj, DTensor):  # FSDP2's shards and the optimizer offload's state: the local tensor
        _walk(obj._local_tensor, path, found, seen, depth + 1)
    elif isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.untyped_storage().nbytes():
            key = (str(obj.device), obj.untyped_storage().data_ptr())
            found.setdefault(key, (path, obj.untyped_storage().nbytes()))
        for attr in ("ds_tensor", "grad"):
            if getattr(obj, attr, None) is not None:
                _walk(getattr(obj, attr), f"{path}.{attr}", found, seen, depth + 1)
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            _walk(v, f"{path}[{k if isinstance(k, str) else type(k).__name__}]", found, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, f"{path}[]", found, seen, depth + 1)
    elif (hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module)
          and type(obj).__module__.startswith(("deepspeed", "torch.optim", "memtrain.backends.optimizer_offload"))):
        for k, v in list(vars(obj).items()):
            _walk(v, f"{path}.{k}", found, seen, depth + 1)


def census(engine, reach: bool = False) -> dict:
    """Bytes DeepSpeed holds now, per component and per attribute path: the reduce buckets first
    (they count as buffers where gradients are views of them), then the model's parameters
    (ZeRO-3's partitioned ones held whole count as ``gathered``), then the rest of the ZeRO optimizer;
    with ``reach``, also the live tensor bytes the walk did not reach (:func:`_not_reached`)."""
    found: dict = {}
    seen: dict = {}
    for bucket in (getattr(engine.optimizer, "ipg_buckets", None) or {}).values():
        _walk(getattr(bucket, "buffer", None), "optimizer.ipg_buckets.buffer", found, seen)
    for p in engine.module.parameters():
        gathered = hasattr(p, "ds_tensor") and not getattr(p, "ds_persist", False)
        for attr, path in (("ds_tensor", "param.ds_tensor"), ("grad", "param.grad")):
            if getattr(p, attr, None) is not None:
                _walk(getattr(p, attr), path, found, seen)
        _walk(p.data, "gathered" if gathered else "param", found, seen)
    _walk(engine.optimizer, "optimizer", found, seen)
    counts = dict.fromkeys((*NAMES, "gathered"), 0)
    paths: dict[str, int] = {}
    for path, nbytes in found.values():
        counts[component(path)] += nbytes
        paths[path] = paths.get(path, 0) + nbytes
    return {"bytes": counts, "paths": paths, **({"not_reached_bytes": _not_reached(found)} if reach else {})}


def _not_reached(found: dict) -> int:
    """Bytes of live tensor storages the walk did not reach (every tensor object the garbage
    collector knows: the data batch, the model's buffers, anything DeepSpeed holds deeper)."""
    import gc

    import torch

    other: dict = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            try:
                storage = obj.untyped_storage()
                key = (str(obj.device), storage.data_ptr())
            except (RuntimeError, NotImplementedError):  # no storage of its own (a DTensor, functional wrappers)
                continue
            if storage.nbytes() and key not in found:
                other[key] = storage.nbytes()
    return sum(other.values())


class Counter:
    """The largest count of each component over the census points, and ZeRO-3's gathered peak."""

    def __init__(self):
        self.largest = dict.fromkeys(NAMES, 0)
        self.points: dict[str, dict] = {}
        self.gathered_bytes = self.not_reached_bytes = 0

    def count(self, engine, point: str) -> None:
        c = census(engine, reach=point == "after_step")
        self.not_reached_bytes = c.pop("not_reached_bytes", self.not_reached_bytes)
        self.points[point] = c
        for k, v in c["bytes"].items():
            if k == "gathered":
                self.gathered_bytes = max(self.gathered_bytes, v)
            else:
                self.largest[k] = max(self.largest[k], v)

    def watch_gathered(self, module) -> None:
        """ZeRO-3: after each fetch of DeepSpeed's parameter coordinator (the only place gathered
        bytes grow: the submodule's parameters and those prefetched with them, in flight or
        arrived), add up the partitioned parameters held whole (their ``data`` is the gathered tensor)."""
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        params = [p for p in module.parameters() if hasattr(p, "ds_tensor") and not getattr(p, "ds_persist", False)]
        if not params:
            return
        fetch = PartitionedParameterCoordinator.fetch_sub_module

        def counted_fetch(coordinator, *args, **kwargs):
            result = fetch(coordinator, *args, **kwargs)
            held = {p.data.untyped_storage().data_ptr(): p.data.untyped_storage().nbytes()
                    for p in params if p.data.numel() > 0}  # each storage once (a coalesced gather shares one)
            self.gathered_bytes = max(self.gathered_bytes, sum(held.values()))
            return result

        PartitionedParameterCoordinator.fetch_sub_module = counted_fetch


def worker(out: str) -> None:
    """Inside each rank (``--worker OUT``): run memtrain with the census hooked into the engine
    (DeepSpeed's or FSDP2's), and write rank 0's counts, the placement planner's prediction and the
    host bytes the run planned for its placement to ``OUT``."""
    from memtrain.api import Trainer
    from memtrain.backends.deepspeed import DeepSpeedBackend
    from memtrain.backends.fsdp import FSDPBackend
    from memtrain import build
    from memtrain.backends.ddp import DDPBackend
    from memtrain.planning import run_placement as planning

    counter, prepare, step = Counter(), DeepSpeedBackend.prepare, DeepSpeedBackend.clip_and_step
    planned, table, resolve = {}, planning.placement_table, build.resolve_placement

    def recorded_table(*args, **kwargs):  # the run's own planning of its placement (its host check)
        rows = table(*args, **kwargs)
        planned["host_bytes"] = rows[0].host_bytes // args[4].ranks_per_host  # (cfg, spec, corpus, world_size, machine, ...)
        return rows

    def recorded_resolve(cfg, corpus, process, precision, source=None, objective=None):
        spec = resolve(cfg, corpus, process, precision, source, objective)
        view = planning.planned_view(cfg, spec)
        if planning.configured_offload(view)[0] == "none":  # the run checks no host then (every rank alike)
            planning._plan_on_main(view, spec, corpus, process, precision, source, objective)  # planned as it would
        return spec

    planning.placement_table, build.resolve_placement = recorded_table, recorded_resolve

    def counted_prepare(self, model, make_optimizer):
        result = prepare(self, model, make_optimizer)
        counter.count(self.engine, "initialize")
        counter.watch_gathered(self.engine.module)
        epilogue = self.engine.optimizer.independent_gradient_partition_epilogue

        def counted_epilogue(*args, **kwargs):
            counter.count(self.engine, "backward_end")
            result = epilogue(*args, **kwargs)
            counter.count(self.engine, "after_epilogue")
            return result

        self.engine.optimizer.independent_gradient_partition_epilogue = counted_epilogue
        return result

    def counted_step(self, model, optimizer, max_norm, skip=False):
        norm = step(self, model, optimizer, max_norm, skip)
        counter.count(self.engine, "after_step")
        if int(os.environ.get("RANK", "0")) == 0:
            _write(out, self, counter, planned)
        return norm

    DeepSpeedBackend.prepare, DeepSpeedBackend.clip_and_step = counted_prepare, counted_step
    fsdp_prepare, fsdp_step = FSDPBackend.prepare, FSDPBackend.clip_and_step

    def fsdp_counted_prepare(self, model, make_optimizer):
        model, optimizer = fsdp_prepare(self, model, make_optimizer)
        self.engine = FSDPHeld(model, optimizer)  # what the census walks
        counter.count(self.engine, "initialize")
        return model, optimizer

    def fsdp_counted_step(self, model, optimizer, max_norm, skip=False):
        counter.count(self.engine, "before_step")  # the sharded gradients are held here
        norm = fsdp_step(self, model, optimizer, max_norm, skip)
        if self.offload_optimizer is not None:
            self.offload_optimizer.synchronize()
        counter.count(self.engine, "after_step")
        if int(os.environ.get("RANK", "0")) == 0:
            _write(out, self, counter, planned)
        return norm

    FSDPBackend.prepare, FSDPBackend.clip_and_step = fsdp_counted_prepare, fsdp_counted_step
    ddp_step = DDPBackend.clip_and_step

    def ddp_counted_step(self, model, optimizer, max_norm, skip=False):  # DDP: the host peak only
        norm = ddp_step(self, model, optimizer, max_norm, skip)
        if int(os.environ.get("RANK", "0")) == 0:
            _write(out, self, counter, planned)
        return norm

    DDPBackend.clip_and_step = ddp_counted_step
    Trainer(args=sys.argv[sys.argv.index("--worker") + 2:], owns_process=True).fit()
    if int(os.environ.get("RANK", "0")) == 0:  # the resident peak of the whole run, its export included
        with open(out) as fh:
            record = json.load(fh)
        record["max_rss_bytes"] = _max_rss_bytes()
        with open(out, "w") as fh:
            json.dump(record, fh)


def _max_rss_bytes() -> int:
    """This process's resident peak so far (``ru_maxrss``, KiB on Linux), bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class FSDPHeld:
    """FSDP2's model and optimizer in the shape :func:`census` walks (``module``, ``optimizer``)."""

    def __init__(self, module, optimizer):
        self.module, self.optimizer = module, optimizer


def _write(out: str, backend, counter: Counter, planned: dict) -> None:
    """Rank 0's record: measured per component, the prediction, the resident set and the host
    bytes per rank the run planned for its placement."""
    from memtrain.planning.placement import Placement, state_bytes

    if backend.name == "ddp":
        placement = Placement("ddp", None, "none")
    elif backend.name == "fsdp":
        placement = Placement("fsdp", None, backend.offload, backend.offload_optimizer_ratio,
                              state_dtype=backend.optimizer_state_dtype)
    else:
        placement = Placement("deepspeed", backend.zero_stage, backend.offload, backend.offload_ratio)
    predicted = state_bytes(placement, backend.shape, backend.precision, backend.world_size)
    measured = {**counter.largest, "gathered": counter.gathered_bytes}
    record = {"parameters": backend.shape.parameters, "measured": measured, "predicted_state": predicted,
              "engine": backend.name, "root_bytes": (4 if backend.precision == "fp32" else 2) * backend.shape.root,
              "same_as_engine": predicted == backend.model_state_bytes(backend.shape.parameters),
              "points": counter.points, "not_reached_bytes": counter.not_reached_bytes,
              "max_rss_bytes": _max_rss_bytes(),
              "planned_host_bytes_per_rank": planned.get("host_bytes")}
    with open(out, "w") as fh:
        json.dump(record, fh)


def predicted_components(state: dict, engine: str = "deepspeed", root_bytes: int = 0) -> dict[str, int]:
    """The accounting's bytes per component (see the module docstring) for a plan that accumulates
    (:data:`ACCUMULATION`): what the engine holds, the step's transients apart (DeepSpeed: the
    whole gradients' bytes or 16-bit's fp32 partition copy in ``step_gradient_bytes``, ZeRO-2's second partition and ZeRO-3's copy of its
    reduce bucket there, ZeRO-3's
    gathered parameters; FSDP2: the root's
    gathered parameters and gradients, ``root_bytes`` each, its two gathered blocks and the
    unsharded gradients of accumulation, all freed by the end of backward)."""
    offloaded = {k: state.get(f"offloaded_{k}_bytes", 0) for k in ("parameter", "gradient", "optimizer", "buffer")}
    if engine == "fsdp":
        return {"parameters": state["parameter_bytes"] - root_bytes + offloaded["parameter"],
                "gradients": state["gradient_bytes"] - root_bytes + offloaded["gradient"],
                "optimizer_state": state["optimizer_bytes"] + offloaded["optimizer"],
                "buffers": state["buffer_bytes"] - state["block_buffer_bytes"] + offloaded["buffer"],
                "other": 0, "gathered": 0}
    held_step = (state["step_gradient_bytes"] - state["step_whole_gradient_bytes"] - state.get("step_reduce_copy_bytes", 0)
                 - state.get("step_accumulated_partition_bytes", 0))
    accumulating = state["accumulation_gradient_bytes"] + state["accumulation_host_bytes"]  # the runs accumulate
    held = max(held_step, accumulating)  # the larger moment (ZeRO-2's partition is both: held to the step)
    return {"parameters": state["parameter_bytes"] + offloaded["parameter"],
            "gradients": state["gradient_bytes"] + held + offloaded["gradient"],
            "optimizer_state": state["optimizer_bytes"] + offloaded["optimizer"],
            "buffers": state["buffer_bytes"] - state["gathered_parameter_bytes"] + offloaded["buffer"],
            "other": 0, "gathered": state["gathered_parameter_bytes"]}


def relative_error(predicted: int, measured: int) -> Optional[float]:
    """(predicted - measured) / measured; None when nothing was measured and nothing predicted."""
    if measured == 0:
        return None if predicted == 0 else float("inf")
    return (predicted - measured) / measured


def rows_for(size: str, placement: str, record: dict) -> list[dict]:
    """One row per held component, ``gathered`` (ZeRO-3) and a ``total`` row of the held ones (the
    sum of each component's largest count, which may come from different census points: an upper
    bound of what is held at once, as the accounting's sum is); then the ``host_peak`` row: the
    host bytes the run planned per rank against rank 0's resident peak over the whole run (its
    export included). DDP: the ``host_peak`` row only."""
    rows = [] if record.get("engine") == "ddp" else _component_rows(size, placement, record)
    planned = record.get("planned_host_bytes_per_rank")
    if planned:  # one process per rank
        rows.append({"size": size, "parameters": record["parameters"], "placement": placement,
                     "component": "host_peak", "predicted_bytes": planned, "measured_bytes": record["max_rss_bytes"],
                     "relative_error": relative_error(planned, record["max_rss_bytes"])})
    return rows


def _component_rows(size: str, placement: str, record: dict) -> list[dict]:
    """:func:`rows_for`'s rows of the engine's census (DeepSpeed's, FSDP2's)."""
    predicted = predicted_components(record["predicted_state"], record.get("engine", "deepspeed"),
                                     record.get("root_bytes", 0))
    rows = []
    for name in (*NAMES, "gathered", "total"):
        p = sum(predicted[k] for k in NAMES) if name == "total" else predicted[name]
        m = sum(record["measured"][k] for k in NAMES) if name == "total" else record["measured"][name]
        if (name == "gathered" and m == p == 0) or (name == "other" and m == 0):
            continue
        rows.append({"size": size, "parameters": record["parameters"], "placement": placement, "component": name,
                     "gradient_accumulation_steps": ACCUMULATION, "predicted_bytes": p, "measured_bytes": m,
                     "relative_error": relative_error(p, m)})
    total = rows[-1]
    total["max_rss_bytes"] = record["max_rss_bytes"]
    total["not_reached_bytes"] = record["not_reached_bytes"]
    total["same_as_engine"] = record["same_as_engine"]
    total["other_paths"] = {k: v for point in record["points"].values() for k, v in point["paths"].items()
                            if component(k) == "other"}
    return rows


def run(size: str, placement: str, scratch: str, steps: int = STEPS) -> list[dict]:
    """Train ``steps`` steps of the ``size`` model under ``placement`` on 2 ranks; its rows."""
    layers, width, heads = SIZES[size]
    out = os.path.join(scratch, "record.json")
    args = [*CPU_ARGS, "--model.config.n_layer", str(layers), "--model.config.n_embd", str(width),
            "--model.config.n_head", str(heads), "--data.seq_len", "32", "--model.config.n_positions", "32",
            "--training.global_batch_size", "8", "--training.micro_batch_size", "2", "--training.max_steps",
            str(steps), "--memory.oom_recovery", "false", *PLACEMENTS[placement]]
    run_memtrain(["--worker", out, *args], os.path.join(scratch, "run"), nproc=2, script=__file__)
    with open(out) as fh:
        return rows_for(size, placement, json.load(fh))


def summary(rows: list[dict]) -> dict:
    """The largest |relative error| of a component, of a total and of a host peak, the largest
    share of a total held by tensors of no known component (``other``: counted in the total,
    predicted 0), and the goals."""
    def worst(selected):
        errors = [abs(r["relative_error"]) for r in selected if r["relative_error"] is not None]
        return max(errors, default=None)

    totals = {(r["size"], r["placement"]): r["measured_bytes"] for r in rows if r["component"] == "total"}
    return {"summary": True, "largest_component_error": worst(r for r in rows if r["component"] in NAMES[:-1]),
            "largest_total_error": worst(r for r in rows if r["component"] == "total"),
            "largest_other_fraction": max((r["measured_bytes"] / totals[r["size"], r["placement"]]
                                           for r in rows if r["component"] == "other"), default=0.0),
            "largest_host_peak_error": worst(r for r in rows if r["component"] == "host_peak"),
            "goal_component": 0.10, "goal_total": 0.05, "goal_host_peak": 0.10}


def main(argv=None) -> int:
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the runs of QUICK (prints only)")
    ap.add_argument("--results", action="store_true", help="append the rows to benchmarks/results/")
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), help="model sizes (default: 25M 86M 300M)")
    ap.add_argument("--placements", nargs="+", choices=list(PLACEMENTS), help="placements (default: all)")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run (default {STEPS})")
    args = ap.parse_args(argv)
    if args.sizes and args.placements:
        runs = [(size, placement) for size in args.sizes for placement in args.placements]
    else:  # QUICK's or FULL's runs, narrowed to the sizes or placements given
        runs = [(size, placement) for size, placement in (QUICK if args.quick else FULL)
                if size in (args.sizes or SIZES) and placement in (args.placements or PLACEMENTS)]
    save = args.results and not args.quick
    rows = []
    for size, placement in runs:
        scratch = scratch_dir("placement-accuracy")
        try:
            for row in run(size, placement, scratch, args.steps):
                rows.append(row)
                emit("placement_accuracy", "cpu", row, save)
        except RunFailed as exc:  # e.g. killed by the kernel: the two ranks need more than this host has
            emit("placement_accuracy", "cpu", {"size": size, "placement": placement, "component": "failed",
                                               "returncode": exc.returncode, "stderr_tail": str(exc)[-600:]}, save)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    emit("placement_accuracy", "cpu", summary(rows), save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
