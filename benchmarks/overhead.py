"""Loop overhead: what memtrain costs when nothing goes wrong.

    python benchmarks/overhead.py --quick                      # CPU, 2 ranks, CI size (< 60 s)
    python benchmarks/overhead.py --engines ddp,fsdp,zero2 --steps 60 --repeats 7 --armed --results
    python benchmarks/overhead.py --device cuda                # recipes/code_lm_350m.yaml on one GPU

The same model, data, global batch, micro-batch and precision are trained by memtrain and by a
plain loop, alternating runs. The plain loops are what a user writes from each engine's
documentation: DDP is the loop Accelerate teaches (``accumulate``, ``backward``,
``clip_grad_norm_``, AdamW, a LambdaLR); FSDP2 is ``fully_shard`` on each block and the root with
``set_requires_gradient_sync`` between accumulation boundaries (Accelerate does not turn FSDP on for
CPU processes); ZeRO-2 is ``deepspeed.initialize`` with ``engine.backward`` / ``engine.step``. Every
plain loop's AdamW has memtrain's two parameter groups (weight decay on matrices only), since ZeRO
keeps one flat partition per group. Reported: the median step time of each, and the ratio
memtrain / plain with min, median and max over repeats, for each run's median step and for its
mean step (wall time per step, slow steps included); the runs alternate and so does which
runs first in a repeat. Goal: ratio ≤ 1.02.

Process settings: memtrain fixes glibc's malloc thresholds (``memory.host_allocator_thresholds``),
steps a fused AdamW and runs the garbage collector every 50 steps (``training.gc_every_steps``). The
``overhead`` ratio (``ratio_*``) compares it with a plain loop given the same settings (the same
thresholds through ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, ``fused=True``, the
automatic collector off and a young-generation pass every 50 steps). ``tuning_gain_*`` is a plain
loop with none of them (a user's defaults) over memtrain: what a user gains by moving to
memtrain (its settings and its overhead together); ``settings_gain_*`` is the same default loop
over the plain loop with the settings: what the settings alone are worth.
``--without_recovery`` adds memtrain with ``memory.oom_recovery false`` to the rotation
(``without_recovery_ratio_*``, over the same plain runs): the loop without the OOM protocol.
``--armed`` adds memtrain with ``faults.arm_oom_agreements true`` (``armed_ratio_*``): the OOM
agreements inside compute (before each FSDP2 block's forward and backward; ZeRO-2's before block
0's backward in each micro-batch, its reduction in one bucket here), which a GPU run makes and a
CPU run makes only where injected faults can raise an OOM; ``oom_agreements`` counts each
variant's agreements over its run (the evaluation before step 1 included). memtrain's extra
work per step: the OOM agreements (shared memory between ranks of one host), the global token
count, the data fingerprint, and — with OOM recovery on — a DDP gradient all-reduce after
backward instead of one overlapped with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (CPU_ARGS, ENGINES, GPU_ARGS, REPO, _free_port, emit, run_memtrain, scratch_dir,  # noqa: E402
                    step_times)

sys.path.insert(0, str(REPO))
from memtrain.host_allocator import policy, threshold_bytes  # noqa: E402


def same_env(device: str) -> dict[str, str]:
    """glibc's thresholds as memtrain sets them on ``device`` (``cpu``: 128 KiB, freed memory
    returned; ``cuda``: 32 / 64 MiB; :func:`memtrain.host_allocator.policy`), for a plain loop's process."""
    mmap, trim = threshold_bytes(policy(None, owns_process=True, cpu_run=device == "cpu")[1])
    return {"MALLOC_MMAP_THRESHOLD_": str(mmap), "MALLOC_TRIM_THRESHOLD_": str(trim)}


GC_EVERY_STEPS = 50
"""memtrain's default ``training.gc_every_steps``."""


def plain_accelerate_loop(memtrain_args: list[str], out_file: str, engine: str = "ddp", same: bool = False) -> tuple:
    """A hand-written training loop of ``engine`` (runs under torchrun); writes its step times.
    Returns the engine's objects (model, optimizer, ...) for the caller to hold until it exits:
    freed here, DDP's reducer destroys its gloo group, whose destructor can wait forever on the
    group's worker threads (a rank of ``--quick``'s plain loop hung so, torchrun gone, its pipe
    open, until the suite's time limit).

    Only the model and the token blocks come from memtrain (so both loops train the same
    thing); everything else is what a user writes from Accelerate's docs. ``same``: memtrain's
    process settings (fused AdamW, the collector every :data:`GC_EVERY_STEPS` steps; the malloc
    thresholds come with the environment, :func:`same_env`).
    """
    import gc

    sys.path.insert(0, str(REPO))
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import build_model
    from memtrain.optim import weight_decay_groups
    from memtrain.precision import resolve_precision

    cfg = parse_args(memtrain_args)
    t = cfg.training
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = t.global_batch_size // (t.micro_batch_size * world)
    cuda = torch.cuda.is_available()
    precision = resolve_precision(cfg.precision, "cuda" if cuda else "cpu")
    accelerator = Accelerator(cpu=not cuda, gradient_accumulation_steps=accumulation,
                              mixed_precision="no" if precision == "fp32" else precision)
    with accelerator.main_process_first():
        corpus = build_corpus(cfg.data)
    set_seed(t.seed)
    model = build_model(cfg.model, corpus.tokenized.vocab_size)

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return len(corpus.train)

        def __getitem__(self, i):
            return {k: v[0] for k, v in corpus.train.batch([i]).items()}

    loader = torch.utils.data.DataLoader(Blocks(), batch_size=t.micro_batch_size, shuffle=True, drop_last=True)

    def plain_optimizer(m):
        """AdamW with memtrain's parameter groups and a linear warm-up, on ``m``'s parameters."""
        optimizer = torch.optim.AdamW(weight_decay_groups(m, t.weight_decay), lr=t.lr, fused=True if same else None)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / t.warmup_steps))

    if same:
        gc.disable()
        gc.collect(1)
    if engine != "ddp":
        return plain_sharded_loop(engine, model, plain_optimizer, accelerator.prepare(loader), t, accumulation,
                                  out_file, same), accelerator
    optimizer, scheduler = plain_optimizer(model)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    times, last, steps = [], time.perf_counter(), 0
    while steps < t.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                logits = model(input_ids=batch["input_ids"]).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                loss.item()  # wait for the step, as memtrain's metrics do
                steps += 1
                if same and steps % GC_EVERY_STEPS == 0:
                    gc.collect(1)
                now = time.perf_counter()
                times.append(now - last)
                last = now
                if steps >= t.max_steps:
                    break
    if accelerator.is_main_process:
        with open(out_file, "w") as fh:
            json.dump(times, fh)
    accelerator.end_training()
    return model, optimizer, loader, scheduler, accelerator


def plain_sharded_loop(engine: str, model, plain_optimizer, loader, t, accumulation: int, out_file: str,
                       same: bool = False) -> tuple:
    """FSDP2 (``fully_shard`` per block, then the root) or DeepSpeed ZeRO-2 (``deepspeed.initialize``),
    each stepped as its documentation shows; writes the step times (rank 0). ``plain_optimizer(model)``
    gives ``(optimizer, scheduler)``: built after ``fully_shard`` (on its sharded parameters), before
    ``deepspeed.initialize`` (which takes the optimizer); ``same``: the collector every
    :data:`GC_EVERY_STEPS` steps (turned off by the caller). Returns the engine's objects, held
    by the caller until it exits (:func:`plain_accelerate_loop`)."""
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from memtrain.models import repeated_blocks

    if engine == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in repeated_blocks(model):
            fully_shard(block)
        fully_shard(model)
        optimizer, scheduler = plain_optimizer(model)
    else:
        import deepspeed

        optimizer, _ = plain_optimizer(model)

        world = dist.get_world_size()
        model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, dist_init_required=False, config={
            "train_batch_size": t.global_batch_size, "train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * world),
            "gradient_clipping": t.max_grad_norm, "zero_optimization": {"stage": 2}, "steps_per_print": 2**31 - 1})
    model.train()
    times, last, micro = [], time.perf_counter(), 0
    while len(times) < t.max_steps:
        for batch in loader:
            micro += 1
            boundary = micro % accumulation == 0
            logits = model(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            if engine == "fsdp":
                model.set_requires_gradient_sync(boundary)
                (loss / accumulation).backward()
                if boundary:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            else:
                model.backward(loss)
                model.step()  # DeepSpeed steps at its own accumulation boundary
            if boundary:
                loss.item()  # wait for the step, as memtrain's metrics do
                if same and (len(times) + 1) % GC_EVERY_STEPS == 0:
                    gc.collect(1)
                now = time.perf_counter()
                times.append(now - last)
                last = now
                if len(times) >= t.max_steps:
                    break
    if dist.get_rank() == 0:
        with open(out_file, "w") as fh:
            json.dump(times, fh)
    return model, optimizer, loader


def run_plain(args: list[str], nproc: int, engine: str = "ddp", same: bool = False,
              device: str = "cpu") -> list[float]:
    """The plain loop's step times (seconds), with memtrain's process settings on ``device`` or
    (``same`` False) a user's defaults."""
    out = os.path.join(scratch_dir("plain"), "times.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), __file__, "--worker", out, engine, "same" if same else "default", "--", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(same_env(device) if same else {})})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"plain loop failed: {proc.stderr[-3000:]}")
    with open(out) as fh:
        times = json.load(fh)
    shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    return times


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # inside torchrun: the plain loop (--worker OUT ENGINE same|default -- ARGS)
        held = plain_accelerate_loop(argv[5:], argv[1], argv[2], argv[3] == "same")  # noqa: F841 (freed by the exit)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip finalisation, which can abort a gloo process at exit (memtrain/train.py, _exit_now)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--engines", default="ddp", help="comma-separated: ddp, fsdp, zero2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (CPU default 2, CUDA default 1)")
    parser.add_argument("--quick", action="store_true", help="CI size: 8 steps, 1 repeat")
    parser.add_argument("--results", action="store_true", help="append to benchmarks/results/overhead-<device>.jsonl")
    parser.add_argument("--without_recovery", action="store_true",
                        help="also time memtrain with memory.oom_recovery false (the loop without the OOM agreements)")
    parser.add_argument("--armed", action="store_true",
                        help="also time memtrain with faults.arm_oom_agreements true (the OOM agreements inside "
                             "compute, made on a GPU and on a CPU run only with injected faults)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 8, 1
    nproc = args.nproc or (2 if args.device == "cpu" else 1)
    if args.device == "cuda":
        base = GPU_ARGS + ["--precision", "bf16", "--training.global_batch_size", "64", "--training.micro_batch_size", "16"]
    else:
        base = CPU_ARGS + ["--training.global_batch_size", "32", "--training.micro_batch_size", "8"]
    base = base + ["--training.max_steps", str(args.steps)]
    for engine in args.engines.split(","):
        if engine not in ENGINES or engine in ("zero3",):
            parser.error(f"--engines: '{engine}' is not one of ddp, fsdp, zero2")
        measure(engine, base + ENGINES[engine], nproc, args)
    return 0


def measure(engine: str, args_: list[str], nproc: int, args) -> None:
    """Alternating repeats of the plain loop and memtrain under ``engine``; emits one JSON row.

    Each run gives two step times over its steps after warm-up: the median step (robust to a
    slow step) and the mean step (the run's wall time per step, i.e. its throughput, which also
    counts the slow steps: a garbage-collector pause, a scheduling hiccup). Each ratio
    memtrain ÷ plain is taken within a repeat; min / median / max over repeats."""
    variants = {"memtrain": [], **({"memtrain_armed": ["--faults.arm_oom_agreements", "true"]} if args.armed else {}),
                **({"memtrain_without_recovery": ["--memory.oom_recovery", "false"]} if args.without_recovery else {})}
    runs: dict[str, list[list[float]]] = {"plain": [], "plain_default": [], **{v: [] for v in variants}}
    points: dict[str, int] = {}  # a memtrain variant's OOM agreements over its run (summary.json)

    def memtrain_times(which: str) -> list[float]:
        out = scratch_dir("memtrain")
        times = step_times(run_memtrain(args_ + variants[which], out, nproc))[args.warmup - 1:]
        points[which] = json.loads((Path(out) / "summary.json").read_text())["oom_agreements"]["points"]
        shutil.rmtree(out, ignore_errors=True)
        return times

    for repeat in range(args.repeats):  # alternate, so drift in machine load hits every variant alike
        order = list(runs)[::1 if repeat % 2 == 0 else -1]
        for which in order:
            runs[which].append(memtrain_times(which) if which in variants else
                               run_plain(args_, nproc, engine, same=which == "plain", device=args.device)[args.warmup:])
    row = {"benchmark": "overhead", "device": args.device, "world_size": nproc, "engine": engine, "steps": args.steps,
           "repeats": args.repeats, "goal": 1.02, "plain_settings": "same"}
    for stat in ("median", "mean"):
        f = getattr(statistics, stat)
        plain, mem = [f(t) for t in runs["plain"]], [f(t) for t in runs["memtrain"]]
        ratios = [m / p for m, p in zip(mem, plain)]
        prefix = "" if stat == "median" else "mean_"
        row.update({f"plain_step_s_{stat}": statistics.median(plain), f"memtrain_step_s_{stat}": statistics.median(mem),
                    f"{prefix}ratio_min": min(ratios), f"{prefix}ratio_median": statistics.median(ratios),
                    f"{prefix}ratio_max": max(ratios), f"{prefix}ratios": ratios})
        default = [f(t) for t in runs["plain_default"]]
        gains = [d / m for d, m in zip(default, mem)]  # > 1: memtrain's settings make it faster than a default loop
        alone = [d / p for d, p in zip(default, plain)]  # the settings without memtrain
        for which in list(variants)[1:]:  # armed: the agreements inside compute, as on a GPU; without the protocol
            other = [m / p for m, p in zip([f(t) for t in runs[which]], plain)]
            name = which[len("memtrain_"):]
            row.update({f"{prefix}{name}_ratio_{k}": g(other) for k, g in
                        (("min", min), ("median", statistics.median), ("max", max))})
            row[f"{prefix}{name}_ratios"] = other  # per repeat, beside ``ratios``: paired comparisons
        row.update({f"plain_default_step_s_{stat}": statistics.median(default),
                    f"{prefix}tuning_gain_min": min(gains), f"{prefix}tuning_gain_median": statistics.median(gains),
                    f"{prefix}tuning_gain_max": max(gains), f"{prefix}tuning_gains": gains,
                    f"{prefix}settings_gain_median": statistics.median(alone), f"{prefix}settings_gains": alone})
    row["oom_agreements"] = points
    emit("overhead", args.device, row, args.results)


if __name__ == "__main__":
    sys.exit(main())
