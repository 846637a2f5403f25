"""Every GPU measurement the README and docs promise, in two parts of nine minutes, then their tables.

    python benchmarks/gpu_suite.py --part 1 --out $OUT      # one GPU: the mission's headline, rows into $OUT
    python benchmarks/gpu_suite.py --part 2 --out $OUT      # the rest (a second command, or a later machine)
    python benchmarks/gpu_suite.py --list                   # one JSON row per step: part, step, limit_s
    python benchmarks/gpu_suite.py --merge DIR              # here: DIR's rows into benchmarks/results/, then the tables
    python benchmarks/gpu_suite.py --only oom_stress,overhead
    python benchmarks/gpu_suite.py --device cpu --quick     # the plumbing on a CPU (the tests): each benchmark
                                                            # at its --quick size; writes no results and no tables
    python benchmarks/gpu_suite.py --rehearse [--part 1]    # the GPU parts rehearsed on this CPU, rows into --out

GPU time is scarce (about 15 minutes on one H100 in all, start-up included, at most 10 minutes a
command), so the steps come in two parts whose time limits add up to :data:`PART_BUDGET_S` (540 s)
each, DeepSpeed's op builds included. Part 1 is the mission's headline: the CUDA-marked tests, the
355M model's CUDA OOM recovery under ``memory.cuda_memory_cap_gib 12`` on DDP, FSDP2 and ZeRO-3
(first OOM → first good step, recovered vs naive halving vs the best static plan,
``micro_batch_size auto``), and the predicted peak against ``max_memory_allocated``. Part 2:
tokens/s eager and compiled, DDP/FSDP2/ZeRO-2 overhead against plain loops, the largest-model runs,
checkpoint I/O.

On a GPU each step runs with ``--results``: every row is appended, and on disk, as soon as it
exists, to ``<name>-<gpu name>.jsonl`` (``nvidia-h100-80gb-hbm3`` say) in ``--out DIR`` (default
``benchmarks/results/``), each row with its commit. Each step has its own time limit; a step that
fails or runs out of time keeps the rows it wrote, is reported, and the suite goes on (a DeepSpeed
op build the time limit stopped has its lock removed, so the next step does not wait on it; the
``cuda_tests`` step, ``-m cuda``, builds no op). Each step's
status rows go to ``DIR/gpu_suite.jsonl`` when it starts and ends; a rerun of a part into the same
folder skips the steps an earlier run started (their rows are kept and never written twice; one
that failed, ran out of time or was cut is still reported as failed), so a part cut short (the
machine taken back) resumes with the next step. Without ``--out`` the suite then writes
``benchmarks/tables.py``'s tables to ``benchmarks/results/gpu_tables.md``; with it, ``--merge DIR``
does that here, once the rows are back (every GPU's tables, each with its provenance).

One JSON row per step on stdout: ``step``, ``part``, ``command``, ``returncode``, ``wall_s``,
``limit_s``, ``rows`` (the step's own JSON rows), ``timed_out``, and ``nothing_tested`` for a test
step whose tests all skipped (a failure, not a pass); last a ``summary`` row. Without a CUDA device
``--device cuda`` (the default) is refused at once (exit 2; the CPU path is ``--device cpu
--quick``), and so is an ``--out`` folder that cannot be written.

``--rehearse`` runs the GPU steps of the parts (or of ``--part``) end to end on this CPU, so that a
plumbing error costs CPU minutes, not GPU minutes: the same orchestration, each benchmark at its
smallest size under its GPU time limit, rows and status into ``--out`` (default: a new temporary
folder, named on stderr), a rerun into it resuming as on a GPU; the CUDA tests are collected
(imported, their fixtures' set-up) rather than run. ``--merge`` takes a rehearsal's folder only
into another results folder (``MEMTRAIN_RESULTS_DIR``), never into benchmarks/results/: its rows
are quick-size CPU rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common import (FORK_SERVER_VAR, REPO, RESULTS, RESULTS_DIR_VAR, device_name, fork_server, run_killable,
                    provenance)
from memtrain.backends.op_locks import JIT_BUILDERS, clear_stale_locks
from tables import staleness

PART_BUDGET_S = 540
"""Each part's limit on one H100, seconds (a command may run 10 minutes; the rest is start-up)."""
STATUS = "gpu_suite.jsonl"
"""The steps' status rows in the output folder (what a rerun of a part skips)."""


@dataclass(frozen=True)
class Step:
    """One measurement: its command on a GPU, at the CPU quick size, its time limit on a GPU
    (seconds), the ``benchmarks/tables.py`` table it feeds (None: its rows are the table), its
    part (1 or 2; 0: a CPU measurement whose plumbing alone runs here, at the quick size) and,
    where the quick size has nothing to run, its command under ``--rehearse``."""

    name: str
    cuda: Optional[tuple[str, ...]]
    quick: Optional[tuple[str, ...]]
    limit_s: int
    table: Optional[str] = None
    part: int = 0
    rehearse: Optional[tuple[str, ...]] = None


STEPS = (
    # part 1: does recovery work on a real GPU, and is the memory prediction right there
    Step("cuda_tests", ("-m", "pytest", "-q", "-rs", "-m", "cuda", "tests"), None, 90, part=1,
         rehearse=("-m", "pytest", "-q", "--collect-only", "-m", "cuda", "tests")),
    Step("oom_stress", ("benchmarks/oom_stress.py", "--device", "cuda", "--engines", "ddp,fsdp,zero3",
                        "--scenario", "steady", "--memory_cap_gib", "12", "--repeats", "1"),
         ("benchmarks/oom_stress.py", "--quick"), 300, "oom_stress", part=1),
    Step("memory_accuracy", ("benchmarks/memory_accuracy.py", "--device", "cuda", "--shape", "gpt2_small",
                             "--precision", "bf16"),
         ("benchmarks/memory_accuracy.py", "--quick"), 150, "memory_accuracy", part=1),
    # part 2: how fast, against the plain loops, and the largest models
    Step("overhead", ("benchmarks/overhead.py", "--device", "cuda", "--engines", "ddp,fsdp,zero2", "--steps", "10",
                      "--repeats", "2"), ("benchmarks/overhead.py", "--quick"), 200, "overhead", part=2),
    Step("compile", ("benchmarks/compile.py", "--device", "cuda", "--steps", "12", "--repeats", "2"),
         ("benchmarks/compile.py", "--quick"), 95, part=2),
    # the flagship first, then the stock comparison at the largest shape its host peak fits (plan
    # rows: 3b); 5 steps (tokens/s from the third), the recipe's global batch of 64 is 4x the step
    Step("largest_model", ("benchmarks/largest_model.py", "--shapes", "10b,3b", "--steps", "5", "--repeats", "1",
                           "--global_batch_size", "16", "--budget_s", "170"),
         ("benchmarks/largest_model.py", "--device", "cpu", "--shapes", "tiny", "--steps", "2", "--repeats", "1"),
         175, part=2),
    Step("checkpoint_io", ("benchmarks/checkpoint_io.py", "--device", "cuda"), ("benchmarks/checkpoint_io.py", "--quick"),
         70, part=2),
    Step("chunked_loss", None, ("benchmarks/chunked_loss.py", "--quick"), 0),  # a CPU measurement: its plumbing only
    Step("lossy_levers", None, ("benchmarks/lossy_levers.py", "--quick"), 0),  # CPU measurements: their plumbing only
    Step("seq_len_reach", None, ("benchmarks/seq_len_reach.py", "--quick"), 0),
    Step("placement_accuracy", None, ("benchmarks/placement_accuracy.py", "--quick"), 0),
    Step("moment_accuracy", None, ("benchmarks/moment_accuracy.py", "--quick"), 0),
    Step("offload_overlap", None, ("benchmarks/offload_overlap.py", "--quick"), 0),
)
PARTS = (1, 2)
assert all(sum(s.limit_s for s in STEPS if s.part == part) <= PART_BUDGET_S for part in PARTS)


def command(step: Step, quick: bool, data_cache_dir: Optional[str], out: Optional[str] = None,
            rehearse: bool = False) -> Optional[list[str]]:
    """The step's command line (None: nothing to run at this size); ``--results`` on a GPU, and at
    the quick size into an ``out`` folder; under ``rehearse`` the quick size, or the step's own
    rehearsal where the quick size has nothing."""
    args = (step.quick or step.rehearse) if rehearse else step.quick if quick else step.cuda
    if args is None:
        return None
    extra = [] if (quick and out is None) or step.name == "cuda_tests" else ["--results"]
    if data_cache_dir and step.name == "memory_accuracy":
        extra += ["--data_cache_dir", data_cache_dir]
    return [sys.executable, *args, *extra]


def run_step(step: Step, cmd: list[str], limit_s: float, env: Optional[dict] = None) -> dict:
    """Run ``cmd`` from the repository root with a time limit (in ``env``, default this process's);
    its JSON lines become ``rows``."""
    start, env = time.perf_counter(), env or dict(os.environ)
    if os.environ.get(FORK_SERVER_VAR) and cmd[1].endswith(".py"):  # the tests' plumbing: forked, imports done once
        done = fork_server().run(cmd, str(REPO / cmd[1]), cmd[2:], nproc=1, port=0, env=env,
                                 cwd=str(REPO), timeout=limit_s, torchrun=False)
        out, err, code, timed_out = done.stdout, done.stderr, done.returncode, done.returncode is None
    else:
        # a session of its own: at the time limit everything it started goes (torchrun's ranks in
        # sessions of their own would otherwise live on and hold the GPU for the next step)
        try:
            done = run_killable(cmd, env, limit_s)
            out, err, code, timed_out = done.stdout, done.stderr, done.returncode, False
        except subprocess.TimeoutExpired as cut:
            out, err, code, timed_out = cut.stdout or "", cut.stderr or "", None, True
            # a DeepSpeed op build the kill stopped leaves its lock, on which every later step would wait
            cleared = clear_stale_locks(JIT_BUILDERS, grace_s=0)
            err += "".join(f"\ngpu_suite: removed {lock}, left by a build the time limit stopped" for lock in cleared)
    rows, nothing_tested = [], cmd[1:3] == ["-m", "pytest"] and code == 0 and not re.search(
        r"\b\d+ passed\b" if "--collect-only" not in cmd else r"\b\d+ tests? collected\b", out)
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return {"step": step.name, "part": step.part, "command": " ".join(cmd[1:]), "returncode": code, "timed_out": timed_out,
            "wall_s": round(time.perf_counter() - start, 1), "limit_s": limit_s, "rows": rows,
            **({"stderr_tail": err[-2000:]} if code != 0 else {}),
            **({"nothing_tested": "every test was skipped: " + out.strip()[-1500:]} if nothing_tested else {})}


def earlier_steps(out: Path) -> dict[str, bool]:
    """``{step: it succeeded}`` for the steps an earlier run of their part into ``out`` started:
    a step is skipped on a rerun once it has started (its rows, even those of a run cut short,
    are kept and never written twice); it succeeded when a status row says it ended with exit 0
    in time (a step cut by the machine's loss has only its ``started`` row)."""
    path = out / STATUS
    earlier: dict[str, bool] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
            earlier[row["step"]] = earlier.get(row["step"], False) or (
                row.get("returncode") == 0 and not row.get("timed_out") and not row.get("started"))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):  # a line cut short by a kill
            pass
    return earlier


def record_status(out: Path, result: dict) -> None:
    """Append ``result``'s status (without its rows, which are in their own files) to ``out``'s
    :data:`STATUS`, on disk before this returns."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / STATUS, "a") as fh:
        fh.write(json.dumps({k: v for k, v in result.items() if k != "rows"} | provenance()) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def rehearsed(folder: Path) -> bool:
    """Whether ``folder``'s status rows are a ``--rehearse`` run's (its rows are CPU rows at the quick size)."""
    path = folder / STATUS
    return path.exists() and any('"rehearsal": true' in line for line in path.read_text().splitlines())


def merge(folder: Path, results: Path = RESULTS) -> dict[str, int]:
    """Append the result rows of ``folder`` (a GPU part's ``--out``) to the files of the same
    name in ``results``, leaving out rows already there; ``{file: rows added}``."""
    added = {}
    for path in sorted(folder.glob("*.jsonl")):
        if path.name == STATUS:
            continue
        target = results / path.name
        have = set(target.read_text().splitlines()) if target.exists() else set()
        new = [line for line in path.read_text().splitlines() if line.startswith("{") and line not in have]
        with open(target, "a") as fh:
            fh.writelines(line + "\n" for line in new)
        added[path.name] = len(new)
    return added


def provenance_note(entry: dict, device: str) -> str:
    """The line under a GPU table: the hardware and commit its rows measured, and **stale** where
    the code they measured changed since (``entry``: a :func:`tables.staleness` entry)."""
    where = f"`{entry['results']}`: {entry['rows']} rows measured on {device}"
    if not entry["newest_commit"]:
        return f"{where}; no row records its commit (stale until measured again)."
    stale = {True: " — **stale**: memtrain/, benchmarks/common.py or the benchmark changed since",
             False: " (the code it measured is unchanged)", None: " (git cannot tell whether the code changed)"}
    return f"{where}, the newest at commit {entry['newest_commit'][:10]}{stale[entry['code_changed_since']]}."


def tables(steps: list[Step], device: Optional[str] = None) -> str:
    """Each step's table from its rows on ``device`` (a GPU's name; None: this machine's GPU)
    (``benchmarks/tables.py``), each with its :func:`provenance_note`, as one Markdown page."""
    device = device or device_name("cuda")
    entries = {e["results"]: e for e in staleness(RESULTS)} if RESULTS.exists() else {}
    parts = ["# GPU tables (generated by benchmarks/gpu_suite.py from benchmarks/results/*-<gpu name>.jsonl)"]
    for step in steps:
        if step.table is None:
            continue
        proc = subprocess.run([sys.executable, "benchmarks/tables.py", step.table, "--device", device],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        entry = entries.get(f"{step.table}-{device}.jsonl")
        parts.append(f"## {step.name}\n\n" + (proc.stdout.strip() if proc.returncode == 0 else
                                             f"(no table: {proc.stderr.strip().splitlines()[-1:]})")
                     + (f"\n\n{provenance_note(entry, device)}" if entry else ""))
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="each benchmark at its CPU --quick size; writes nothing")
    parser.add_argument("--part", type=int, choices=PARTS, default=None, help="run one part (default: both)")
    parser.add_argument("--only", default=None, help="comma-separated step names (default: all of the parts)")
    parser.add_argument("--out", default=None, help="the folder every result row and step status is written to "
                                                     "(on a remote GPU machine, the one that comes back)")
    parser.add_argument("--list", action="store_true", help="print each step's part and time limit, run nothing")
    parser.add_argument("--merge", default=None, metavar="DIR", help="append a part's --out rows to benchmarks/results/ "
                                                                     "and write the tables; run nothing")
    parser.add_argument("--data_cache_dir", default=None, help="a corpus cache for memory_accuracy to reuse")
    parser.add_argument("--rehearse", action="store_true",
                        help="the GPU steps of the parts end to end on this CPU at their smallest size, under their GPU "
                             "time limits, rows into --out (default: a new temporary folder)")
    parser.add_argument("--budget_s", type=float, default=None,
                        help=f"the run's time limit in seconds (default {PART_BUDGET_S} per part); steps past it are "
                             "skipped")
    args = parser.parse_args(argv)
    if args.list:
        for step in STEPS:
            print(json.dumps({"part": step.part, "step": step.name, "limit_s": step.limit_s}))
        return 0
    if args.merge:
        if rehearsed(Path(args.merge)) and RESULTS.resolve() == (REPO / "benchmarks" / "results").resolve():
            parser.error(f"--merge {args.merge}: a CPU rehearsal's rows (the quick size), not a GPU's; they never go into "
                         f"benchmarks/results/ (set {RESULTS_DIR_VAR} to merge them into another folder)")
        added = merge(Path(args.merge))
        print(json.dumps({"merged": added}))
        devices = sorted({p.stem.split("-", 1)[1] for p in RESULTS.glob("*-*.jsonl")} - {"cpu"})  # name-<gpu>.jsonl
        if devices:  # every GPU's tables, the ones merged before included
            (RESULTS / "gpu_tables.md").write_text("\n".join(tables([s for s in STEPS if s.part], d) for d in devices))
        return 0
    if args.rehearse:
        args.device, args.quick = "cpu", True
        if args.out is None:
            args.out = tempfile.mkdtemp(prefix="memtrain-rehearse-")
            print(f"gpu_suite: the rehearsal's rows and status go to {args.out}", file=sys.stderr)
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu runs the plumbing only: add --quick (the GPU tables need a GPU)")
    if args.device == "cuda" and not cuda_available():
        parser.error("--device cuda (the default): this machine has no CUDA device, and every step would fail or "
                     "skip; on a CPU run the plumbing: --device cpu --quick")
    chosen = [s for s in _chosen(parser, args) if s.part or not args.rehearse]  # a rehearsal: the GPU parts
    mark = {"rehearsal": True} if args.rehearse else {}
    out = Path(args.out).resolve() if args.out else None
    if out is not None:
        _check_writable(parser, out)
    env = {**os.environ, **({RESULTS_DIR_VAR: str(out)} if out else {})}
    earlier = earlier_steps(out) if out else {}
    budget = args.budget_s if args.budget_s is not None else PART_BUDGET_S * len({s.part for s in chosen if s.part} or {1})
    started, results = time.perf_counter(), []
    for step in chosen:
        cmd = command(step, args.quick, args.data_cache_dir, args.out, args.rehearse)
        left = budget - (time.perf_counter() - started)
        if cmd is None or left <= 0 or step.name in earlier:
            results.append({"step": step.name, "part": step.part, "skipped": f"started in an earlier run into {out}"
                            if step.name in earlier else f"nothing to run {'at the quick size' if args.quick else 'on a GPU'}"
                            if cmd is None else "the run's time budget is spent"})
        else:
            if out:
                record_status(out, {"step": step.name, "part": step.part, "started": True, **mark})
            limit = step.limit_s if args.rehearse or not args.quick else 600
            results.append(run_step(step, cmd, min(limit, left), env))
            if out:
                record_status(out, {**results[-1], **mark})
        print(json.dumps(results[-1]), flush=True)
    failed = [r["step"] for r in results if r.get("returncode") not in (0, None) or r.get("timed_out")
              or r.get("nothing_tested")
              or (r["step"] in earlier and not earlier[r["step"]])]  # an earlier run's failure is still one
    if not args.quick and out is None:
        page = tables(chosen)
        (REPO / "benchmarks" / "results" / "gpu_tables.md").write_text(page)
        print(page, file=sys.stderr)
    print(json.dumps({"summary": {"steps": len(results), "failed": failed,
                                  "wall_s": round(time.perf_counter() - started, 1), "budget_s": budget}}))
    return 1 if failed else 0


def cuda_available() -> bool:
    """Whether torch sees a CUDA device here."""
    import torch

    return torch.cuda.is_available()


def _check_writable(parser: argparse.ArgumentParser, out: Path) -> None:
    """Refuse (exit 2, naming ``--out``) a folder the rows cannot be written to, before any step runs."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".gpu_suite_write_test_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        parser.error(f"--out {out}: cannot write there ({exc.strerror}); choose a folder this user can write")


def _chosen(parser: argparse.ArgumentParser, args) -> list[Step]:
    """The steps ``--part`` and ``--only`` select (at the quick size without ``--part``, the CPU
    measurements' plumbing too)."""
    in_part = [s for s in STEPS if (s.part == args.part if args.part else s.part or args.quick)]
    names = args.only.split(",") if args.only else [s.name for s in in_part]
    known = {s.name for s in (in_part if args.part else STEPS)}
    if set(names) - known:
        parser.error(f"steps {sorted(set(names) - known)} are not {f'in part {args.part}' if args.part else 'steps'}; "
                     f"choose from {', '.join(sorted(known))}")
    return [s for s in STEPS if s.name in names]


if __name__ == "__main__":
    sys.exit(main())
