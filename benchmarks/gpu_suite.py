"""Every GPU measurement the README and docs promise, in one command, then their tables.

    python benchmarks/gpu_suite.py                          # one GPU: the CUDA tests, every benchmark, the tables
    python benchmarks/gpu_suite.py --only oom_stress,overhead
    python benchmarks/gpu_suite.py --budget_s 540           # less GPU time: the first steps that fit
    python benchmarks/gpu_suite.py --device cpu --quick     # the plumbing on a CPU (the tests): each benchmark
                                                            # at its --quick size; writes no results and no tables

On a GPU each step runs with ``--results`` (rows appended to ``benchmarks/results/<name>-<gpu name>.jsonl``,
``nvidia-h100-80gb-hbm3`` say)
under its own time limit, the steps' limits adding up to :data:`BUDGET_S` (25 minutes on one
H100); a step that fails or runs out of time is reported and the suite goes on. Then
``benchmarks/tables.py <name> --device <gpu name>`` prints each table generated from those rows, and
the suite writes them to ``benchmarks/results/gpu_tables.md`` for the docs.

Steps, in order, most telling per minute first (less time than the budget, ``--budget_s``,
gets the first ones; the CUDA tests first: they tell soonest whether the GPU-only paths work).
Each launch of the 355M model costs about 30 s on an H200 (start-up, build, steps), which sizes
the repeats:

* ``cuda_tests``: ``pytest -m cuda`` (the tests that need a GPU: real CUDA OOMs, NCCL, fp16, …).
* ``memory_accuracy``: the predicted peak against MemTracker and ``max_memory_allocated`` (bf16,
  GPT-2 small's blocks, 4 engines × AC off/on, one rank).
* ``overhead``: memtrain's step time over the engine's plain loop (DDP, FSDP2, ZeRO-2).
* ``compile``: eager vs ``training.compile`` tokens/s.
* ``oom_stress``: the 355M model (``recipes/code_lm_350m.yaml``) under ``memory.cuda_memory_cap_gib 12``,
  4 engines, steady and spike: first OOM → first good step, recovered vs naive halving vs best
  static plan, ``micro_batch_size auto``.
* ``largest_model``: the 6.7B and 10B Llama shapes, memtrain's placement vs the stock
  ``ds_configs/zero3_offload.json``, device and host peaks.
* ``checkpoint_io``: save, blocked and load seconds per checkpoint format.
* ``chunked_loss``, ``lossy_levers``, ``seq_len_reach``: CPU measurements; at the quick size only
  (their plumbing).

One JSON row per step on stdout: ``step``, ``command``, ``returncode``, ``wall_s``, ``limit_s``,
``rows`` (the step's own JSON rows), ``timed_out``; last a ``summary`` row.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from common import FORK_SERVER_VAR, REPO, device_name, fork_server

BUDGET_S = 25 * 60
"""The whole suite's limit on one H100, seconds."""


@dataclass(frozen=True)
class Step:
    """One measurement: its command on a GPU, at the CPU quick size, its time limit on a GPU
    (seconds) and the ``benchmarks/tables.py`` table it feeds (None: its rows are the table)."""

    name: str
    cuda: Optional[tuple[str, ...]]
    quick: Optional[tuple[str, ...]]
    limit_s: int
    table: Optional[str] = None


STEPS = (
    Step("cuda_tests", ("-m", "pytest", "-q", "-rs", "-m", "cuda", "tests"), None, 90),
    Step("memory_accuracy", ("benchmarks/memory_accuracy.py", "--device", "cuda", "--shape", "gpt2_small",
                             "--precision", "bf16"),
         ("benchmarks/memory_accuracy.py", "--quick"), 240, "memory_accuracy"),
    Step("overhead", ("benchmarks/overhead.py", "--device", "cuda", "--engines", "ddp,fsdp,zero2", "--steps", "12",
                      "--repeats", "2"), ("benchmarks/overhead.py", "--quick"), 420, "overhead"),
    Step("compile", ("benchmarks/compile.py", "--device", "cuda", "--steps", "16", "--repeats", "2"),
         ("benchmarks/compile.py", "--quick"), 180),
    Step("oom_stress", ("benchmarks/oom_stress.py", "--device", "cuda", "--engines", "ddp,fsdp,zero2,zero3",
                        "--scenario", "both", "--memory_cap_gib", "12", "--repeats", "3"),
         ("benchmarks/oom_stress.py", "--quick"), 240, "oom_stress"),
    Step("largest_model", ("benchmarks/largest_model.py", "--shapes", "6.7b,10b", "--steps", "20", "--repeats", "1"),
         ("benchmarks/largest_model.py", "--device", "cpu", "--shapes", "tiny", "--steps", "2", "--repeats", "1"),
         240),
    Step("checkpoint_io", ("benchmarks/checkpoint_io.py", "--device", "cuda"), ("benchmarks/checkpoint_io.py", "--quick"),
         90),
    Step("chunked_loss", None, ("benchmarks/chunked_loss.py", "--quick"), 0),  # a CPU measurement: its plumbing only
    Step("lossy_levers", None, ("benchmarks/lossy_levers.py", "--quick"), 0),  # CPU measurements: their plumbing only
    Step("seq_len_reach", None, ("benchmarks/seq_len_reach.py", "--quick"), 0),
    Step("placement_accuracy", None, ("benchmarks/placement_accuracy.py", "--quick"), 0),
)
assert sum(s.limit_s for s in STEPS) <= BUDGET_S


def command(step: Step, quick: bool, data_cache_dir: Optional[str]) -> Optional[list[str]]:
    """The step's command line (None: nothing to run at this size); ``--results`` on a GPU."""
    args = step.quick if quick else step.cuda
    if args is None:
        return None
    extra = [] if quick or step.name == "cuda_tests" else ["--results"]
    if data_cache_dir and step.name == "memory_accuracy":
        extra += ["--data_cache_dir", data_cache_dir]
    return [sys.executable, *args, *extra]


def run_step(step: Step, cmd: list[str], limit_s: float) -> dict:
    """Run ``cmd`` from the repository root with a time limit; its JSON lines become ``rows``."""
    start = time.perf_counter()
    if os.environ.get(FORK_SERVER_VAR) and cmd[1].endswith(".py"):  # the tests' plumbing: forked, imports done once
        done = fork_server().run(cmd, str(REPO / cmd[1]), cmd[2:], nproc=1, port=0, env=dict(os.environ),
                                 cwd=str(REPO), timeout=limit_s, torchrun=False)
        out, err, code, timed_out = done.stdout, done.stderr, done.returncode, done.returncode is None
    else:
        # a process group of its own: at the time limit the whole group goes (torchrun's workers
        # would otherwise live on and hold the GPU for the next step)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=limit_s)
            code, timed_out = proc.returncode, False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            code, timed_out = None, True
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return {"step": step.name, "command": " ".join(cmd[1:]), "returncode": code, "timed_out": timed_out,
            "wall_s": round(time.perf_counter() - start, 1), "limit_s": limit_s, "rows": rows,
            **({"stderr_tail": err[-2000:]} if code != 0 else {})}


def tables(steps: list[Step]) -> str:
    """Each step's table from its CUDA rows (``benchmarks/tables.py``), as one Markdown page."""
    parts = ["# GPU tables (generated by benchmarks/gpu_suite.py from benchmarks/results/*-<gpu name>.jsonl)"]
    for step in steps:
        if step.table is None:
            continue
        proc = subprocess.run([sys.executable, "benchmarks/tables.py", step.table, "--device", device_name("cuda")],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        parts.append(f"## {step.name}\n\n" + (proc.stdout.strip() if proc.returncode == 0 else
                                             f"(no table: {proc.stderr.strip().splitlines()[-1:]})"))
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="each benchmark at its CPU --quick size; writes nothing")
    parser.add_argument("--only", default=None, help="comma-separated step names (default: all)")
    parser.add_argument("--data_cache_dir", default=None, help="a corpus cache for memory_accuracy to reuse")
    parser.add_argument("--budget_s", type=float, default=BUDGET_S,
                        help=f"the suite's time limit in seconds (default {BUDGET_S}); steps past it are skipped")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu runs the plumbing only: add --quick (the GPU tables need a GPU)")
    names = args.only.split(",") if args.only else [s.name for s in STEPS]
    unknown = set(names) - {s.name for s in STEPS}
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; choose from {', '.join(s.name for s in STEPS)}")
    chosen = [s for s in STEPS if s.name in names]
    started, results = time.perf_counter(), []
    for step in chosen:
        cmd = command(step, args.quick, args.data_cache_dir)
        left = args.budget_s - (time.perf_counter() - started)
        if cmd is None or left <= 0:
            results.append({"step": step.name, "skipped": f"nothing to run {'at the quick size' if args.quick else 'on a GPU'}"
                            if cmd is None else "the suite's time budget is spent"})
        else:
            results.append(run_step(step, cmd, min(step.limit_s if not args.quick else 600, left)))
        print(json.dumps(results[-1]), flush=True)
    failed = [r["step"] for r in results if r.get("returncode") not in (0, None) or r.get("timed_out")]
    if not args.quick:
        page = tables(chosen)
        (REPO / "benchmarks" / "results" / "gpu_tables.md").write_text(page)
        print(page, file=sys.stderr)
    print(json.dumps({"summary": {"steps": len(results), "failed": failed,
                                  "wall_s": round(time.perf_counter() - started, 1), "budget_s": args.budget_s}}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
