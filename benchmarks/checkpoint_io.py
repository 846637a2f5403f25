"""Checkpoint I/O: save and load time and bytes per engine and format, and for asynchronous
saves the time the training loop is blocked.

    python benchmarks/checkpoint_io.py --quick                 # CPU, 2 ranks: FSDP2 async (< 30 s)
    python benchmarks/checkpoint_io.py --results --plot ckpt.png
    python benchmarks/checkpoint_io.py --device cuda --formats ddp,fsdp,fsdp_async,zero3

Each configuration trains ``--steps`` steps saving every ``--every`` steps, then a second run
resumes from the last checkpoint (``resume: auto``) for one more step. Reported per
configuration: checkpoint bytes, median save seconds (first write to committed manifest),
median seconds the loop was blocked by a save, and the load seconds of the resume — taken from
the ``checkpoint_saved`` and ``resume`` events memtrain writes to ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CPU_ARGS, ENGINES, GPU_ARGS, bar_chart, emit, run_memtrain, scratch_dir  # noqa: E402

FORMATS = {
    "ddp": ("safetensors", ENGINES["ddp"]),
    "fsdp": ("torch.distributed.checkpoint", ENGINES["fsdp"]),
    "fsdp_async": ("torch.distributed.checkpoint async", ENGINES["fsdp"] + ["--checkpoint.async_save", "true"]),
    "zero2": ("deepspeed", ENGINES["zero2"]),
    "zero3": ("deepspeed", ENGINES["zero3"]),
}


def measure(name: str, args) -> dict:
    fmt, engine_args = FORMATS[name]
    if args.device == "cuda":
        base = GPU_ARGS + ["--precision", "bf16", "--training.global_batch_size", "32", "--training.micro_batch_size", "16"]
    else:
        base = CPU_ARGS + ["--training.global_batch_size", "16", "--training.micro_batch_size", "8"]
    base = base + engine_args + ["--checkpoint.every_steps", str(args.every), "--checkpoint.keep_last", "2"]
    out = scratch_dir(f"ckpt-{name}")
    try:
        records = run_memtrain(base + ["--training.max_steps", str(args.steps)], out, args.nproc)
        saves = [e for r in records for e in r.get("plan_changes", []) if e["event"] == "checkpoint_saved"]
        resumed = run_memtrain(base + ["--training.max_steps", str(args.steps + 1)], out, args.nproc)
        load = next(e for e in resumed[-1].get("plan_changes", []) if e["event"] == "resume")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    step_s = statistics.median(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])
                               if "event" not in b)
    return {
        "benchmark": "checkpoint_io", "device": args.device, "world_size": args.nproc, "config": name, "format": fmt,
        "checkpoints": len(saves), "bytes": saves[-1]["bytes"] if saves else None,
        "save_s_median": statistics.median(e["save_s"] for e in saves) if saves else None,
        "blocked_s_median": statistics.median(e["blocked_s"] for e in saves) if saves else None,
        "load_s": load["load_s"], "train_step_s_median": step_s,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated: {','.join(FORMATS)}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=None, help="ranks (CPU default 2, CUDA default 1)")
    parser.add_argument("--quick", action="store_true", help="CI size: fsdp_async, 4 steps")
    parser.add_argument("--results", action="store_true", help="append to benchmarks/results/checkpoint_io-<device>.jsonl")
    parser.add_argument("--plot", default=None, help="write a PNG chart of save/blocked/load seconds here")
    args = parser.parse_args(argv)
    args.nproc = args.nproc or (2 if args.device == "cpu" else 1)
    names = args.formats.split(",")
    if args.quick:
        names, args.steps, args.every = ["fsdp_async"], 4, 2
    rows = []
    for name in names:
        if name not in FORMATS:
            parser.error(f"--formats: '{name}' is not one of {', '.join(FORMATS)}")
        rows.append(measure(name, args))
        emit("checkpoint_io", args.device, rows[-1], args.results)
    if args.plot:
        bar_chart(args.plot, f"Checkpoint I/O ({args.device}, {args.nproc} ranks)", [r["config"] for r in rows],
                  {"save": [r["save_s_median"] for r in rows], "loop blocked": [r["blocked_s_median"] for r in rows],
                   "load": [r["load_s"] for r in rows]}, "seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
