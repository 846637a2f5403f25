"""FSDP2's optimizer offload with its CPU step overlapped with the next forward, against the same
step not overlapped (``backend.host_step_overlap true|false``), and both against the placement
planner's step seconds.

    python benchmarks/offload_overlap.py --quick            # 1.8M GPT-2, 2 repeats (prints only; the tests run it)
    python benchmarks/offload_overlap.py --results          # 25M GPT-2, 5 repeats, appended to benchmarks/results/

On 2 CPU ranks (gloo, fp32; global batch 8 in micro-batches of 2) a GPT-2 trains ``--steps`` steps
with all of its optimizer state on the host (``--ratio``, default 1.0: the most CPU work), the two
settings alternating run by run and which goes first alternating by repeat. Each run's step time is
the median of its steps after the first two (``elapsed_s`` of metrics.jsonl). Rows: one per run
(``overlap``, ``repeat``, ``step_s``), then a summary with min / median / max of each setting's
step, the ratio overlapped / not overlapped per repeat, and the planner's prediction of each: its
``predicted_step_s`` (overlapped) and ``device_s + host_step_s + copy_s`` (not overlapped) from
``memtrain plan --json`` for the same run. On a CPU the "device" is the same cores as the host, so
the overlap can only hide the CPU step behind a forward that competes with it for those cores; on a
GPU the forward runs on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

from common import CPU_ARGS, emit, run_cli, run_memtrain, scratch_dir, spread, step_times

SIZES = {"1.8M": (2, 256, 4), "25M": (8, 512, 8)}  # GPT-2: (layers, width, heads)


def run_args(size: str, steps: int, ratio: float) -> list[str]:
    layers, width, heads = SIZES[size]
    return [*CPU_ARGS, "--model.config.n_layer", str(layers), "--model.config.n_embd", str(width),
            "--model.config.n_head", str(heads), "--data.seq_len", "32", "--model.config.n_positions", "32",
            "--training.global_batch_size", "8", "--training.micro_batch_size", "2", "--training.max_steps",
            str(steps), "--backend.name", "fsdp", "--backend.offload", "optimizer",
            "--backend.offload_optimizer_ratio", str(ratio)]


def predicted(args: list[str]) -> dict:
    """The planner's seconds for the run's placement: overlapped and not."""
    out = run_cli(["plan", *args, "--world_size", "2", "--json"], ok_codes=(0, 3))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    row = next(r for r in rows if r.get("placement") and r["engine"] == "fsdp" and r["offload"] == "optimizer")
    return {"predicted_overlapped_s": row["predicted_step_s"],
            "predicted_not_overlapped_s": row["device_s"] + row["host_step_s"] + row["copy_s"],
            "predicted_host_step_s": row["host_step_s"], "predicted_device_s": row["device_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1.8M GPT-2, 2 repeats of 6 steps (prints only)")
    ap.add_argument("--results", action="store_true", help="append the rows to benchmarks/results/")
    ap.add_argument("--size", choices=list(SIZES), default="25M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ratio", type=float, default=1.0, help="the share of the optimizer state on the host")
    args = ap.parse_args(argv)
    size, repeats, steps = ("1.8M", 2, 6) if args.quick else (args.size, args.repeats, args.steps)
    save = args.results and not args.quick
    base = run_args(size, steps, args.ratio)
    times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(repeats):
        for overlap in ((True, False) if repeat % 2 == 0 else (False, True)):
            scratch = scratch_dir("offload-overlap")
            try:
                records = run_memtrain([*base, "--backend.host_step_overlap", str(overlap).lower()],
                                       os.path.join(scratch, "run"), nproc=2)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            step_s = statistics.median(step_times(records)[2:])
            times[overlap].append(step_s)
            emit("offload_overlap", "cpu", {"size": size, "ratio": args.ratio, "overlap": overlap, "repeat": repeat,
                                            "step_s": step_s}, save)
    ratios = [a / b for a, b in zip(times[True], times[False])]
    emit("offload_overlap", "cpu", {"summary": True, "size": size, "ratio": args.ratio, "repeats": repeats,
                                    "overlapped_step_s": spread(times[True]),
                                    "not_overlapped_step_s": spread(times[False]),
                                    "overlapped_over_not": spread(ratios), **predicted(base)}, save)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
