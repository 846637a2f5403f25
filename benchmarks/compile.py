"""torch.compile: tokens/s of the same run compiled per block (``training.compile true``) and eager.

    python benchmarks/compile.py --quick                  # CPU, 1 rank, CI size
    python benchmarks/compile.py --steps 40 --repeats 3 --results
    python benchmarks/compile.py --device cuda            # recipes/code_lm_350m.yaml on one GPU

Eager and compiled runs alternate. The first ``--warmup`` steps of each run (the compile) are
left out of its tokens/s; the compile cost (cold: an empty inductor cache per run) is reported
separately as the extra seconds of those steps. Reported: median tokens/s of each, the ratio compiled / eager (min, median, max over
repeats) and the largest relative loss difference between the two at any step.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CPU_ARGS, GPU_ARGS, emit, run_memtrain, scratch_dir  # noqa: E402


def one_run(args, compiled: bool) -> dict:
    base = CPU_ARGS if args.device == "cpu" else GPU_ARGS
    out = scratch_dir("compile")
    try:
        records = run_memtrain([*base, "--training.max_steps", str(args.steps), "--backend.name", "ddp",
                                "--training.compile", str(compiled).lower()], out, nproc=1,
                               env={"TORCHINDUCTOR_CACHE_DIR": str(Path(out) / "inductor")})  # a cold compile
    finally:
        shutil.rmtree(out, ignore_errors=True)
    timed = records[args.warmup:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "warmup_s": records[args.warmup - 1]["elapsed_s"], "losses": [r["loss"] for r in records]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (quick: 6)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s (quick: 2)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats (quick: 1)")
    parser.add_argument("--quick", action="store_true", help="CI size: 6 steps, 1 repeat")
    parser.add_argument("--results", action="store_true", help="append to benchmarks/results/compile-<device>.jsonl")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 6, 2, 1
    runs = {"eager": [], "compiled": []}
    for _ in range(args.repeats):  # alternating, so machine noise hits both alike
        for name in runs:
            runs[name].append(one_run(args, name == "compiled"))
    ratios = [c["tokens_per_s"] / e["tokens_per_s"] for e, c in zip(runs["eager"], runs["compiled"])]
    loss_diff = max(abs(a - b) / abs(a) for e, c in zip(runs["eager"], runs["compiled"])
                    for a, b in zip(e["losses"], c["losses"]))
    emit("compile", args.device, {
        "device": args.device, "steps": args.steps, "warmup_steps": args.warmup, "repeats": args.repeats,
        "tokens_per_s": {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()},
        "ratio_compiled_to_eager": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
        "compile_s": statistics.median(c["warmup_s"] - e["warmup_s"] for e, c in zip(runs["eager"], runs["compiled"])),
        "max_rel_loss_diff": loss_diff,
    }, args.results)


if __name__ == "__main__":
    main()
