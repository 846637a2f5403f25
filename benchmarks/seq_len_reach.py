"""How long a sequence trains under one fixed memory budget: the planner with ``memory.levers
off`` (the micro-batch and activation checkpointing off/on) against ``memory.levers auto`` (also
selective AC and chunked cross-entropy). Lossless levers only. The ratio (the goal) is without
activation offload; ``auto_offload`` (``memory.levers auto`` that may also offload activations to
host memory, which the simulated device counts as host) is reported beside it (not in
``--quick``).

    python benchmarks/seq_len_reach.py --quick                 # the plumbing (< 2 min)
    python benchmarks/seq_len_reach.py --results

2 CPU ranks (gloo, fp32), the benchmarks' 4-layer GPT-2 (64 wide, vocab 1024, positions up to
4096), 2 samples per rank per step, ``training.micro_batch_size auto``, on a simulated device
(``faults.memory_budget_mib``) whose budget is what ``memtrain plan`` predicts that device counts
for the smallest plan (micro-batch 1, full AC) at ``--base_seq_len`` tokens, plus 1 KiB: the
longest sequence the planner without levers can fit. Each mode then trains 2 steps at
``base × 2^k`` tokens for k = 0, 1, …; the longest that exits 0 is its reach (a run that cannot
fit stops with exit 3 before step 1). Reported: both reaches, their ratio (goal: ≥ 2), the plan
each mode chose at each length, and any out-of-memory event (none expected).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CPU_ARGS, ENGINES, RunFailed, emit, run_memtrain, scratch_dir  # noqa: E402
from solver import MODES, OFFLOAD_MODE, OOM_EVENTS, chosen, predicted  # noqa: E402


def base_args(engine: str, nproc: int, seq_len: int) -> list[str]:
    return CPU_ARGS + ENGINES[engine] + [
        "--model.config.n_positions", "4096", "--data.seq_len", str(seq_len), "--training.eval_samples", "2",
        "--training.global_batch_size", str(2 * nproc), "--training.micro_batch_size", "auto",
        "--training.max_steps", "2"]


def floor_budget_mib(engine: str, nproc: int, seq_len: int) -> float:
    """MiB per rank of micro-batch 1 with full AC at ``seq_len`` (levers off), + 1 KiB."""
    rows = predicted(base_args(engine, nproc, seq_len), nproc)
    peak = next(r["predicted_peak_bytes"] for r in rows if r["micro_batch_size"] == 1
                and r["activation_checkpointing"] == "on" and not r.get("chunked_cross_entropy"))
    return (peak + 1024) / 2**20


def reach(engine: str, nproc: int, mode: str, budget: float, lengths: list[int]) -> tuple[int, dict, int]:
    """The longest of ``lengths`` (ascending) that trains under ``mode``; the plan at each length
    that trained; out-of-memory events seen."""
    longest, plans, ooms = 0, {}, 0
    for seq_len in lengths:
        out = scratch_dir(f"reach_{engine}_{mode}_{seq_len}_")
        try:
            records = run_memtrain(base_args(engine, nproc, seq_len) + {**MODES, **OFFLOAD_MODE}[mode]
                                   + ["--faults.memory_budget_mib", repr(budget)], out, nproc)
        except RunFailed as exc:
            if not re.search(r"exitcode\s*:\s*3\b", exc.stderr):  # 3: no plan fits (torchrun itself exits 1)
                raise
            break
        finally:
            shutil.rmtree(out, ignore_errors=True)
        longest, plans[seq_len] = seq_len, chosen(records)
        ooms += sum(e["event"] in OOM_EVENTS for r in records for e in r.get("plan_changes", []))
    return longest, plans, ooms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="ddp,fsdp")
    ap.add_argument("--base_seq_len", type=int, default=64)
    ap.add_argument("--doublings", type=int, default=5, help="lengths tried: base × 1, 2, …, 2^doublings")
    ap.add_argument("--quick", action="store_true", help="DDP, base and 2× base only, nothing written")
    ap.add_argument("--results", action="store_true", help="append to benchmarks/results/seq_len_reach-cpu.jsonl")
    args = ap.parse_args(argv)
    engines, doublings = args.engines.split(","), args.doublings
    if args.quick:
        engines, doublings = engines[:1], 1
    lengths = [args.base_seq_len * 2**k for k in range(doublings + 1)]
    for engine in engines:
        budget = floor_budget_mib(engine, 2, args.base_seq_len)
        result = {"benchmark": "seq_len_reach", "engine": engine, "world_size": 2, "budget_mib": budget,
                  "base_seq_len": args.base_seq_len, "lengths_tried": lengths}
        for mode in [*MODES, *([] if args.quick else OFFLOAD_MODE)]:
            longest, plans, ooms = reach(engine, 2, mode, budget, lengths)
            result[mode] = {"longest_seq_len": longest, "plans": plans, "oom_events": ooms}
        result["ratio_auto_to_off"] = result["auto"]["longest_seq_len"] / max(1, result["off"]["longest_seq_len"])
        emit("seq_len_reach", "cpu", result, args.results and not args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
