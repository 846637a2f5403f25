"""The memory solver: what ``memory.levers auto`` (selective activation checkpointing and chunked
cross-entropy beside the micro-batch and full AC) buys over the planner without it. The
activation-offload lever is left out (``memory.activation_offload off``): on a CPU host and device
are one memory and its copies are charged, not timed.

    python benchmarks/solver.py --device cpu --quick                   # the plumbing (< 2 min)
    python benchmarks/solver.py --engines ddp,fsdp --repeats 3 --results

Per engine (2 CPU ranks, gloo, fp32, a 0.4M-parameter GPT-2), on a simulated device
(``faults.memory_budget_mib``) at three budgets taken from ``memtrain plan``'s predictions —
*tight* (full AC fits at a quarter of a rank's share), *medium* (selective AC fits at half of
it; full AC under ZeRO-3, which has no selective AC), *loose* (the whole share fits without AC) — two runs with ``training.micro_batch_size auto``
in alternating order, ``--repeats`` times: ``memory.levers off`` (the micro-batch and AC off/on)
and ``memory.levers auto``. Reported per budget: each mode's chosen plan (the ``plan_chosen``
event of the last repeat), tokens/s after the planning step (min/median/max over repeats), the
ratio auto ÷ off taken per repeat (min/median/max), and the out-of-memory events of each mode
(0 expected: the planner predicts what fits). A third run per repeat starts ``auto`` at the whole
share in one micro-batch (16, too large below the loose budget): its out-of-memory recovery,
which asks the same planner, should land on the plan ``auto`` chose before step 1
(``recovery_lands_on_auto_plan``; its tokens/s include the recovery).

``--exhaustive`` times, instead, ``memory.levers auto`` against every lever setting (AC off,
selective or on × chunked cross-entropy off or on) at the largest micro-batch ``memtrain plan``
predicts to fit the budget, each run with that plan fixed (``memory.levers off``), all in
alternating order ``--repeats`` times: the fastest by median tokens/s among those that ran
without an out-of-memory event is the best found, and ``ratio_auto_to_best`` (per repeat,
min/median/max) says how close the solver's own choice came (goal: within 5%).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CPU_ARGS, ENGINES, emit, run_cli, run_memtrain, scratch_dir, spread, tokens_per_s  # noqa: E402

NO_OFFLOAD = ["--memory.activation_offload", "off"]
"""The solver's goals are measured without the activation-offload lever: on a CPU its copies are
charged at a stated bandwidth, not timed (memtrain/levers/activation_offload.py)."""
MODES = {"off": ["--memory.levers", "off"], "auto": ["--memory.levers", "auto", *NO_OFFLOAD]}
OFFLOAD_MODE = {"auto_offload": ["--memory.levers", "auto", "--memory.activation_offload", "auto"]}
"""``memory.levers auto`` that may also offload activations (reported beside, not in the goals)."""
OOM_EVENTS = ("oom_shrink", "oom_replan", "activation_checkpointing_on", "grow_back_failed")


def recovery(per_rank: int) -> dict[str, list[str]]:
    """Out-of-memory recovery under ``memory.levers auto``: the whole share in one micro-batch, too
    large at the tight and medium budgets; where the recovery lands is compared with ``auto``'s plan."""
    return {"auto_from_whole_share": ["--memory.levers", "auto", *NO_OFFLOAD, "--training.micro_batch_size", str(per_rank)]}


def predicted(base: list[str], nproc: int) -> list[dict]:
    """``memtrain plan --json`` rows of every micro-batch and lever combination (``memory.levers
    auto``, no activation offload), as the simulated device counts them (a budget too large to bind: the planner then
    predicts what that device counts, model state and saved activations)."""
    out = run_cli(["plan", *base, "--memory.levers", "auto", *NO_OFFLOAD, "--world_size", str(nproc), "--json",
                   "--faults.memory_budget_mib", "1000000"])
    return [r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{")) if not r.get("placement")]


def budgets(rows: list[dict], per_rank: int) -> dict[str, float]:
    """MiB per rank of the three budgets (each the predicted peak of its plan + 1 KiB; *medium* is
    full AC at half the share where the engine has no selective AC: ZeRO-3)."""
    def peak(micro: int, ac: str) -> int:
        return next(r["predicted_peak_bytes"] for r in rows if r["micro_batch_size"] == micro
                    and r["activation_checkpointing"] == ac and not r.get("chunked_cross_entropy"))
    medium = "selective" if any(r["activation_checkpointing"] == "selective" for r in rows) else "on"
    plans = {"tight": (per_rank // 4, "on"), "medium": (per_rank // 2, medium), "loose": (per_rank, "off")}
    return {name: (peak(*plan) + 1024) / 2**20 for name, plan in plans.items()}


def chosen(records: list[dict]) -> str:
    """The plan the planner chose before step 1, as ``micro×accum + levers``."""
    event = next((e for r in records for e in r.get("plan_changes", []) if e["event"] == "plan_chosen"), None)
    if event is None:
        return "?"
    return f"{event['new']} AC {event['activation_checkpointing']}" + (
        " + chunked CE" if event.get("chunked_cross_entropy") else "") + (
        " + activation offload" if event.get("activation_offload") == "on" else "")


def final_plan(records: list[dict]) -> str:
    """The plan of the last step, as :func:`chosen` writes one."""
    r = [r for r in records if "micro_batch_size" in r][-1]
    return (f"{r['micro_batch_size']}×{r['gradient_accumulation_steps']} AC {r['activation_checkpointing']}"
            + (" + chunked CE" if r.get("chunked_cross_entropy") else ""))


def alternate(args: list[str], runs: dict[str, list[str]], nproc: int, repeats: int,
              label: str) -> tuple[dict[str, list[float]], dict[str, int], dict[str, list[dict]]]:
    """Each of ``runs`` (name → its extra arguments) ``repeats`` times in alternating order, so
    the machine's drift hits each alike: tokens/s after step 2 per repeat, the out-of-memory
    events summed over the repeats, and each run's records of its last repeat."""
    tps: dict[str, list[float]] = {m: [] for m in runs}
    ooms, last = {m: 0 for m in runs}, {}
    for _ in range(repeats):
        for run, extra in runs.items():
            out = scratch_dir(f"{label}_")
            records = run_memtrain(args + extra, out, nproc)
            shutil.rmtree(out, ignore_errors=True)
            tps[run].append(tokens_per_s(records[2:]))
            ooms[run] += sum(e["event"] in OOM_EVENTS for r in records for e in r.get("plan_changes", []))
            last[run] = records
    return tps, ooms, last


def measure(engine: str, nproc: int, steps: int, repeats: int, names: list[str], per_rank: int = 16) -> list[dict]:
    base = CPU_ARGS + ENGINES[engine] + ["--training.global_batch_size", str(per_rank * nproc),
                                         "--training.micro_batch_size", "auto", "--training.max_steps", str(steps)]
    limits = budgets(predicted(base, nproc), per_rank)
    recovering = recovery(per_rank)
    results = []
    for name in names:
        args = base + ["--faults.memory_budget_mib", repr(limits[name])]
        tps, ooms, last = alternate(args, {**MODES, **recovering}, nproc, repeats, f"solver_{engine}_{name}")
        plans = {mode: final_plan(records) if mode in recovering else chosen(records) for mode, records in last.items()}
        results.append({
            "benchmark": "solver", "engine": engine, "world_size": nproc, "steps": steps, "repeats": repeats,
            "budget": name, "budget_mib": limits[name], "plan": plans, "oom_events": ooms,
            "tokens_per_s": {m: spread(v) for m, v in tps.items()},
            "ratio_auto_to_off": spread([a / b for a, b in zip(tps["auto"], tps["off"])]),
            "recovery_lands_on_auto_plan": plans["auto_from_whole_share"] == plans["auto"],
        })
    return results


def fitting_settings(rows: list[dict], budget_bytes: float) -> dict[str, list[str]]:
    """Each lever setting at its largest micro-batch predicted to fit ``budget_bytes``, as a name
    (``micro×accum AC x [+ chunked CE]``) and the arguments that fix that plan."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["activation_checkpointing"], bool(r.get("chunked_cross_entropy")))
        if r["predicted_peak_bytes"] <= budget_bytes and r["micro_batch_size"] > best.get(key, {}).get("micro_batch_size", 0):
            best[key] = r
    return {f"{r['micro_batch_size']}×{r['gradient_accumulation_steps']} AC {ac}" + (" + chunked CE" if ce else ""):
            ["--memory.levers", "off", "--training.micro_batch_size", str(r["micro_batch_size"]),
             "--memory.activation_checkpointing", ac, "--memory.chunked_cross_entropy", str(ce).lower()]
            for (ac, ce), r in sorted(best.items())}


def measure_exhaustive(engine: str, nproc: int, steps: int, repeats: int, names: list[str]) -> list[dict]:
    """``memory.levers auto`` against every fitting lever setting, per budget (the module docstring)."""
    per_rank = 16
    base = CPU_ARGS + ENGINES[engine] + ["--training.global_batch_size", str(per_rank * nproc),
                                         "--training.max_steps", str(steps)]
    rows = predicted(base + ["--training.micro_batch_size", "auto"], nproc)
    limits = budgets(rows, per_rank)
    results = []
    for name in names:
        args = base + ["--faults.memory_budget_mib", repr(limits[name])]
        runs = {"auto": ["--memory.levers", "auto", *NO_OFFLOAD, "--training.micro_batch_size", "auto"],
                **fitting_settings(rows, limits[name] * 2**20)}
        tps, ooms, last = alternate(args, runs, nproc, repeats, f"solver_all_{engine}_{name}")
        auto_plan = chosen(last["auto"])
        fitted = [m for m in runs if m != "auto" and ooms[m] == 0] or [m for m in runs if m != "auto"]
        best = max(fitted, key=lambda m: statistics.median(tps[m]))  # every one ran out of memory: the fastest
        results.append({
            "benchmark": "solver_exhaustive", "engine": engine, "world_size": nproc, "steps": steps,
            "repeats": repeats, "budget": name, "budget_mib": limits[name], "auto_plan": auto_plan,
            "best_setting": best, "oom_events": ooms, "tokens_per_s": {m: spread(v) for m, v in tps.items()},
            "ratio_auto_to_best": spread([a / b for a, b in zip(tps["auto"], tps[best])]),
        })
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu"])
    ap.add_argument("--engines", default="ddp,fsdp")
    ap.add_argument("--budgets", default="tight,medium,loose")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="one engine, the tight budget, 6 steps, 1 repeat, 8 samples per rank (not 16)")
    ap.add_argument("--results", action="store_true",
                    help="append to benchmarks/results/solver-cpu.jsonl (--exhaustive: solver_exhaustive-cpu.jsonl)")
    ap.add_argument("--exhaustive", action="store_true",
                    help="time auto against every lever setting at its largest fitting micro-batch")
    args = ap.parse_args(argv)
    engines, names = args.engines.split(","), args.budgets.split(",")
    steps, repeats = args.steps, args.repeats
    if args.quick:
        engines, names, steps, repeats = engines[:1], ["tight"], 6, 1
    for engine in engines:
        rows = (measure_exhaustive(engine, 2, steps, repeats, names) if args.exhaustive else
                measure(engine, 2, steps, repeats, names, 8 if args.quick else 16))
        for result in rows:
            emit(result["benchmark"], args.device, result, args.results)  # solver, solver_exhaustive
    return 0


if __name__ == "__main__":
    sys.exit(main())
